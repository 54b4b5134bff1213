"""One loop steps every model: outside generation/ no module feeds a model token by token itself.

Every generation (generate, chat, serve, bench, plan, eval, trace, and the benchmarks that time moestream)
runs through generation/serving.py's scheduler, so a figure times the path users run. This test reads the
source (src/ and benchmarks/) and fails where a module outside generation/ builds its own forward loop: a
`Forward` of its own, a model called with `past_key_values`, or transformers' `generate` on a model, unless
the module is listed below with the reason it must."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOOP_HOME = ROOT / "src" / "moestream" / "generation"

# Modules that step a model outside the loop on purpose, and why.
ALLOWED = {
    # transformers' own generate is the peer these compare with (not moestream's speed)
    "benchmarks/all_hits_vs_transformers.py": "transformers' generate is the peer it measures",
    # one prompt pass against the same prompt in pieces: a prefill, not a decode loop
    "benchmarks/prefill_pieces.py": "times one prompt pass against pieces of it, no token-by-token step",
}


def _own_loops(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name == "Forward":
            found.append(f"line {node.lineno}: builds a Forward")
        elif any(k.arg == "past_key_values" for k in node.keywords):
            found.append(f"line {node.lineno}: calls a model with past_key_values")
        elif name == "generate" and isinstance(node.func, ast.Attribute) and "model" in ast.unparse(node.func.value):
            found.append(f"line {node.lineno}: runs transformers' generate")
    return found


def test_no_module_outside_generation_steps_a_model_itself():
    sources = [*(ROOT / "src").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    offenders = {}
    for path in sources:
        relative = path.relative_to(ROOT).as_posix()
        if path.is_relative_to(LOOP_HOME) or relative in ALLOWED:
            continue
        if found := _own_loops(path):
            offenders[relative] = found
    assert not offenders, f"step the model through generation/serving.py (teacher_forced, timed, stream): {offenders}"


def test_the_check_finds_a_loop_of_its_own(tmp_path):
    """The scan is not blind: each of the three ways is found in a module written for the test."""
    source = tmp_path / "loop.py"
    source.write_text(
        "def run(model, ids, Forward):\n"
        "    forward = Forward(model)\n"
        "    past = model(ids, past_key_values=None).past_key_values\n"
        "    model.generate(ids, max_new_tokens=4)\n"
    )
    assert sorted(line.split(":")[0] for line in _own_loops(source)) == ["line 2", "line 3", "line 4"]
    for listed in ALLOWED:
        assert _own_loops(ROOT / listed), f"{listed} no longer steps a model itself: take it off the list"
