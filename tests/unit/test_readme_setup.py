"""The README's set-up (issue 52, friction): two commands, the CPU torch line before the
install that needs it, the demo's command installing the package alone (none of `[dev]`),
the test command exactly what CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import requires

from conftest import REPO

# The import names of the `[dev]` requirements (and what moto's server extra brings).
IMPORT_NAME = {"pytest-timeout": "pytest_timeout", "pytest-xdist": "xdist", "lm-eval": "lm_eval",
               "kubernetes-validate": "kubernetes_validate", "moto": "moto"}  # fmt: skip
NOT_A_MODULE = {"ruff"}  # a binary


def setup_block() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, section
    return section, block.group(1).splitlines()


def test_two_commands_the_cpu_torch_line_first_and_the_tests_as_ci_runs_them():
    section, lines = setup_block()
    commands = [x.split("  #")[0].strip() for x in lines if x.strip() and not x.startswith("#")]
    assert commands[0].startswith("python3 -m venv .venv")
    assert commands[1:] == [
        "pip install -e . && plm demo",
        "pip install -e '.[dev]' && python -m pytest -q -n 2 --dist loadgroup tests",
    ], commands
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == "pip install -q -e '.[dev]' && python -m pytest -q -n 2 --dist loadgroup tests"
    assert commands[2].split(" && ")[1] == ci.split(" && ")[1]  # the same test command
    torch = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    block = "\n".join(lines)
    assert torch in block and block.index(torch) < block.index("pip install -e .")
    assert section.index("CPU `torch`") < section.index("```bash")


def test_the_demos_modules_import_without_any_dev_requirement():
    """What the demo runs (tokenizer, prepare, train, MLflow, fine-tuning, the pyfunc
    models) imports with every `[dev]` requirement unimportable. (A fresh venv of
    `pip install -e .` ran the whole demo, 2026-12-02: docs/setup.md.)"""
    dev = [re.split(r"[<>=!\[; ]", r, maxsplit=1)[0]
           for r in requires("plm-pipeline") if 'extra == "dev"' in r]  # fmt: skip
    blocked = sorted({IMPORT_NAME.get(n, n.replace("-", "_")) for n in dev} - NOT_A_MODULE)
    assert {"transformers", "moto", "selenium", "lm_eval", "kubernetes_validate"} <= set(blocked)
    blocked += ["cfnlint", "botocore", "_pytest"]  # moto[server]'s, boto3's, pytest's
    code = f"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (a [dev] requirement)")
sys.meta_path.insert(0, Absent())
import pipeline.cli, pipeline.demo, pipeline.prepare.tokenizer, pipeline.prepare.prepare
import pipeline.prepare.job, pipeline.train.trainer, pipeline.train.tracking
import pipeline.finetune.loop, pipeline.finetune.demo_task, pipeline.finetune.pyfunc
import pipeline.models.pyfunc, mlflow, mlflow.pyfunc, deepspeed, ray, tokenizers
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
