"""Stage and task names: one `Stage` and one `TaskKind` (`k6vsr_core.contract.stage_names`), used by every product
module
in place of string literals, and stored as the same strings as before."""

from __future__ import annotations

import json
import re
from pathlib import Path

from k6vsr_core.contract.stage_names import Stage, TaskKind
from storage.records import CompletionRecord, RecordBook
from tasks import ingest, quality, stage_tasks

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("k6vsr_core", "storage", "service", "tasks", "runtime", "flows", "entrypoints")
NAMES = {*Stage, *TaskKind}
# Words that are a stage's name but mean something else where they are written.
OTHER_MEANINGS = {
    "k6vsr_core/media/streams.py": {"encode"},  # a stream's plan: re-encoded, not copied
    "storage/__init__.py": {"publish"},  # a function's name in `__all__`
    "tasks/quality.py": {"quality"},  # the folder of the report's parts
    "entrypoints/cli.py": {"preview"},  # a command's name
    "entrypoints/commands/plan.py": {"segment"},  # a window's frames in the printed plan
    "entrypoints/console.py": {"segment"},  # a word of the plan's printed summary
    "entrypoints/server/worker_slots.py": {"quality"},  # a job's quality report
    "entrypoints/server/routes.py": {"quality"},  # a job's quality report
}


def test_product_modules_name_stages_through_the_enums() -> None:
    pattern = re.compile(r"(?<![\w-])[\"'](" + "|".join(sorted(NAMES, key=len, reverse=True)) + r")[\"'](?![\w-])")
    found = {}
    for room in PRODUCT:
        for path in sorted((ROOT / room).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if name == "k6vsr_core/contract/stage_names.py":
                continue
            words = set(pattern.findall(path.read_text("utf-8"))) - OTHER_MEANINGS.get(name, set())
            if words:
                found[name] = sorted(words)
    assert found == {}


def test_a_record_is_stored_as_the_same_bytes_as_with_a_plain_string(tmp_path: Path) -> None:
    book = RecordBook(tmp_path / "done")
    record = book.write(Stage.DECODE, "3", "ab", seconds=1.5, attempt="x")
    plain = {"stage": "decode", "item": "3", "checksum": "ab", "seconds": 1.5, "written_at": record.written_at}
    assert record.seal and record.intact()  # sealed over the same fields, the stage among them as its string
    expected = json.dumps({**plain, "attempt": "x", "seal": record.seal}, indent=2, sort_keys=True).encode()
    assert (tmp_path / "done" / "decode" / "3.json").read_bytes() == expected
    line = (tmp_path / "timeline.jsonl").read_text()
    assert line.startswith('{"stage": "decode", "item": "3", ')
    read = book.read(Stage.DECODE, "3")
    assert read is not None and read.stage is Stage.DECODE and read.stage == "decode"
    assert CompletionRecord.model_validate_json(expected) == record


def test_every_task_kind_names_a_prefect_task() -> None:
    tasks = [getattr(module, name) for module in (ingest, quality, stage_tasks) for name in dir(module)]
    names = {task.name for task in tasks if type(task).__name__ == "Task"}
    assert set(TaskKind) <= names
    assert all(isinstance(name, str) for name in names)
