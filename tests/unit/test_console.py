import io

from llmtrain.config import MetricsConfig
from llmtrain.metrics.console import ConsoleReporter, StepReport


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


REPORT = StepReport(step=50, loss=2.5, tokens_per_s=12345.0, step_time_s=0.2, lr=1e-3,
                    grad_norm=0.5, mfu=None, memory_gb=1.0)


def test_bar_on_a_terminal_plain_lines_in_logs():
    term, log = Terminal(), io.StringIO()
    ConsoleReporter(MetricsConfig(), total_steps=100, stream=term).step(REPORT)
    ConsoleReporter(MetricsConfig(), total_steps=100, stream=log).step(REPORT)
    assert term.getvalue().startswith("\r[" + "#" * 15 + "." * 15 + "] 50/100")
    assert "ETA 0m10s" in term.getvalue() and "\n" not in term.getvalue()
    assert log.getvalue() == ("step 50/100 | loss 2.5000 | lr 1.00e-03 | gnorm 0.500 | "
                              "12,345 tok/s | 200 ms/step | mem 1.00 GB | ETA 0m10s\n")


def test_progress_setting_overrides_detection():
    log = io.StringIO()
    ConsoleReporter(MetricsConfig(progress="bar"), total_steps=100, stream=log).step(REPORT)
    assert log.getvalue().startswith("\r[")


def test_the_last_line_says_which_steps_this_process_trained():
    from llmtrain import Summary
    out = io.StringIO()
    console = ConsoleReporter(MetricsConfig(), total_steps=1000, stream=out)
    whole = dict(tokens=0, wall_s=10.0, tokens_per_s=0.0, first_loss=2.0, final_loss=1.0,
                 memory_gb=0.1, complete=True)
    console.ended(Summary(steps=1000, trained=1000, **whole))
    console.ended(Summary(steps=1000, trained=400, **whole))  # resumed (or joined) at 600
    first, second = out.getvalue().splitlines()
    assert first.startswith("done: 1000 steps in 10.0 s;"), first
    assert second.startswith("done: 1000 steps (400 trained here from step 600) in"), second
