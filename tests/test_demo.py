"""`moestream demo` (the README's main job) runs end to end on its quick model."""

from moestream.tools.demo import run_demo


def test_quick_demo_runs_and_skew_raises_the_hit_rate(tmp_path, capsys):
    rows = run_demo(workdir=str(tmp_path), tokens=8, quick=True)
    out = capsys.readouterr().out
    assert "RANDOM weights" in out and "model on disk" in out
    assert len(rows) == 7  # five budgets, then random vs skewed at one budget
    for row in rows:
        assert 0.0 <= row["hit_rate"] <= 1.0 and row["mb_read"] > 0
        # Speeds by generate.Timing's definition: decode tok/s leaves the prefill (in the TTFT) out.
        assert row["ttft_s"] > 0 and row["decode_tokens_per_s"] > 0
    assert "decode tok/s" in out and "TTFT s" in out
    random_routers, skewed_routers = rows[-2], rows[-1]
    assert skewed_routers["hit_rate"] > random_routers["hit_rate"]
    assert skewed_routers["mb_read"] < random_routers["mb_read"]
