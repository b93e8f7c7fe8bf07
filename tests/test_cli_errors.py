"""CLI error paths shared by every command: unwritable outputs and bad problem files exit 2, no traceback."""

import json

from fxpipe.cli import main
from fxpipe.ir import ScheduleProblem


def test_unwritable_output_path_exits_2(tmp_path, capsys):
    prob = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=1, t_b=1, t_w=1).save(tmp_path / "p.json")
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where a folder is expected
    code = main(["schedule", str(prob), "--out", str(blocker / "sub" / "s.json")])
    err = capsys.readouterr().err
    assert code == 2 and "error" in err and "Traceback" not in err


def test_null_field_in_problem_exits_2(tmp_path, capsys):
    doc = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=1, t_b=1, t_w=1).to_dict()
    doc["t_comm"] = None
    (tmp_path / "p.json").write_text(json.dumps(doc))
    code = main(["schedule", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert code == 2 and "t_comm" in err
