"""Each process loads only what its role needs; the packages import each other one way; the
structure document names every file and says truly which process and module loads torch.

Rules (docs/structure.md, "Which process loads what"):
- the router and the gateway load no torch, triton, kernels, kvtransfer or engine executor,
  also when the gateway starts on an empty model cache;
- the prefill worker never imports the decode service, nor the decode worker the prefill one;
- the engine package imports nothing from kvtransfer or services.router;
- kvtransfer imports nothing from services.

The processes are the real commands, each in a fresh interpreter, run until ready and then
stopped: what they loaded while serving counts. The package rules are checked twice: every
module imported in a fresh interpreter, and every import statement of the source (so an
import inside a function cannot hide). PDSERVE_WRITE_LAYERING=1 rewrites the process table
of docs/structure.md from what was measured instead of comparing.
"""

from __future__ import annotations

import os

import pytest

from tests.layering import (
    STRUCTURE, TABLE_BEGIN, TABLE_END, expand, imported_in_fresh_interpreter, imports, loaded, loads_torch,
    module_name, process_table, repo_modules, run_process, table_rows, tracked_files,
)

pytestmark = pytest.mark.slow

_WORKER = ["--kv-cache-gb", "0.05", "--transport", "tcp", "--threads", "1"]  # the default model, as deployed
PROCESSES = {  # name -> (argv after `pdserve`, extra environment)
    "gateway": (["gateway", "--port", "0", "--grpc-port", "0"], {}),
    "gateway, empty model cache": (["gateway", "--port", "0", "--grpc-port", "0"], {"PDSERVE_CACHE_DIR": "cold"}),
    "router": (["router", "--port", "0"], {}),
    "prefill worker": (["prefill", *_WORKER], {}),
    "decode worker": (["decode", *_WORKER], {}),
}
COMMANDS = {"gateway": "pdserve gateway", "gateway, empty model cache": "PDSERVE_CACHE_DIR=<empty> pdserve gateway",
            "router": "pdserve router", "prefill worker": "pdserve prefill", "decode worker": "pdserve decode"}
FRONT = ("gateway", "gateway, empty model cache", "router")


@pytest.fixture(scope="module")
def measured(redis_url, tmp_path_factory) -> dict[str, set[str]]:
    out = {}
    for name, (argv, env) in PROCESSES.items():
        tmp = tmp_path_factory.mktemp("process")
        env = {k: str(tmp / v) if k == "PDSERVE_CACHE_DIR" else v for k, v in env.items()}
        out[name] = run_process([*argv, "--redis-url", redis_url], tmp / "modules.json", env)
    return out


def _package_modules(package: str) -> list[str]:
    return sorted(m for m in repo_modules() if m == package or m.startswith(package + "."))


def _offending(mods: set[str], packages: tuple[str, ...]) -> list[str]:
    """Which of ``packages`` were loaded, each with an example module of it."""
    return [f"{p} (e.g. {min(m for m in mods if m == p or m.startswith(p + '.'))})"
            for p in packages if loaded(mods, p)]


@pytest.mark.parametrize("name", FRONT)
def test_router_and_gateway_load_no_torch_kernels_or_kvtransfer(measured, name):
    heavy = ("torch", "triton", "kernels", "kvtransfer", "services.engine.engine", "services.worker")
    assert _offending(measured[name], heavy) == [], f"{name} loaded what only workers need"
    assert loaded(measured[name], "tokenizers") or name == "router"  # the gateway did load its tokenizer


def test_each_worker_loads_only_its_own_role(measured):
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        mods = measured[f"{role} worker"]
        assert loaded(mods, f"services.{role}")
        assert _offending(mods, (f"services.{other}",)) == [], f"the {role} worker loaded the {other} service"
    for role, other in (("decode", "prefill"), ("prefill", "decode")):
        for module in _package_modules(f"services.{role}"):
            named = [m for m in imports(module, top_level_only=False) if m.startswith(f"services.{other}")]
            assert named == [], f"{module} imports {named}"


@pytest.mark.parametrize("package, forbidden", [
    ("services.engine", ("kvtransfer", "services.router")),
    ("kvtransfer", ("services",)),
])
def test_package_imports_nothing_from_above_it(package, forbidden):
    for module in _package_modules(package):  # every import statement, inside functions too
        named = [m for m in imports(module, top_level_only=False) if m.split(".")[0] in forbidden
                 or any(m == f or m.startswith(f + ".") for f in forbidden)]
        assert named == [], f"{module} imports {named}"
    mods = imported_in_fresh_interpreter(_package_modules(package))
    assert _offending(mods, forbidden) == [], f"importing {package} loaded these"


def test_process_table_of_the_structure_document_is_what_the_processes_load(measured):
    text = STRUCTURE.read_text()
    assert TABLE_BEGIN in text and TABLE_END in text, "docs/structure.md lost its process-table markers"
    head, rest = text.split(TABLE_BEGIN)
    _, tail = rest.split(TABLE_END)
    table = process_table(measured, COMMANDS)
    if os.environ.get("PDSERVE_WRITE_LAYERING"):
        STRUCTURE.write_text(f"{head}{TABLE_BEGIN}\n{table}\n{TABLE_END}{tail}")
        return
    assert rest.split(TABLE_END)[0].strip() == table, "docs/structure.md's process table is stale; " \
        "rerun with PDSERVE_WRITE_LAYERING=1 to rewrite it from what the processes load"


def test_structure_document_lists_every_file_and_no_other():
    files = tracked_files()
    listed = [f for names, _ in table_rows(STRUCTURE.read_text()) for f in expand(names, files)]
    missing = sorted(set(files) - set(listed))
    assert missing == [], "files docs/structure.md does not list (one line each on its job)"
    stale = sorted(set(listed) - set(files))
    assert stale == [], "docs/structure.md names files that do not exist"


def test_structure_torch_column_says_which_modules_import_torch():
    files = tracked_files()
    wrong = []
    for names, cells in table_rows(STRUCTURE.read_text()):
        if not cells or cells[-1] not in ("yes", "no"):
            continue
        for path in expand(names, files):
            if path.endswith(".py") and (cells[-1] == "yes") != loads_torch(module_name(path)):
                wrong.append(f"{path}: says {cells[-1]}")
    assert wrong == [], "the torch? column (does importing it load torch) is wrong for these"
