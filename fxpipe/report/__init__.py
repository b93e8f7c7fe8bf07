"""Reports of fxpipe's results for people: HTML / Markdown, charts, schedule pictures, traces.

* :mod:`fxpipe.report.document`: the self-contained HTML (and Markdown) report of a
  partition and its lower-bound certificates (:func:`write_report`).
* :mod:`fxpipe.report.plan_report`: the report of a :class:`fxpipe.Plan`
  (:func:`write_plan_report`: plan, schedule, memory sections on top of the partition report).
* :mod:`fxpipe.report.charts`: stage-cost, certificate and memory charts (PNG bytes).
* :mod:`fxpipe.report.gantt`: a schedule's Gantt chart with memory curves
  (:func:`gantt`, formerly ``fxpipe.schedule.plot``).
* :mod:`fxpipe.report.trace`: a schedule's Chrome/Perfetto trace (:func:`chrome_trace`).
* :mod:`fxpipe.report.format`: numbers in positional notation, one unit per column.

No torch import anywhere in this package; matplotlib is imported only when a chart is drawn.
"""

from fxpipe.report.document import ReportSection, render_html, render_markdown, stage_table, write_report
from fxpipe.report.gantt import gantt
from fxpipe.report.plan_report import plan_memory_section, write_plan_report
from fxpipe.report.trace import chrome_trace

__all__ = ["ReportSection", "write_report", "write_plan_report", "plan_memory_section", "stage_table", "render_html",
           "render_markdown", "gantt", "chrome_trace"]
