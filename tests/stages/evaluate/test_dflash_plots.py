"""The evaluate stage's plots for a DFlash drafter: engine-only metrics, training metrics.csv
with DFlash's acc_1.. columns (EAGLE-3's start at acc_0)."""

from eaglet.stages import evaluate


def test_plots_take_dflash_metrics(tmp_path):
    run = {"acceptance_length": 1.8, "acceptance_rate": [0.5, 0.4, 0.2], "greedy_equal": True}
    metrics = {
        "drafter": "d",
        "suites": {"q": {"eaglet": {}, "vllm": {"temperature_0": {"num_steps_3": run}}}},
        "offline": {},
    }
    rows = [
        {"step": str(s), "loss": "2.0", "lr": "1e-3", "grad_norm": "1", "acc_1": "0.5",
         "acc_2": "0.3", "acc_3": "0.1"}
        for s in range(3)
    ]  # fmt: skip
    evaluate.plot(metrics, rows, tmp_path)
    assert all((tmp_path / f).stat().st_size for f in ("acceptance.png", "suites.png", "loss.png"))
