"""kvpop.progress: a tqdm bar on a terminal, a line per N steps into a file or a pipe."""
import io

import pytest

from kvpop.progress import LineProgress, NullProgress, progress


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_not_a_terminal_writes_a_line_every_n_steps():
    out = io.StringIO()
    bar = progress(100, desc="kvpop train", file=out, every=10)
    assert isinstance(bar, LineProgress)
    for i in range(100):
        bar.set_postfix(kl=f"{i:.4f}", score="0.5")  # the step's figures, then the step
        bar.update(1)
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 10  # steps 10, 20, ..., 100; close adds none (100 was written)
    assert lines[0].startswith("kvpop train: 10/100 (10%)") and "kl=9.0000, score=0.5" in lines[0]
    assert lines[-1].startswith("kvpop train: 100/100 (100%)") and "kl=99.0000" in lines[-1]
    assert "ETA" in lines[0] and "ETA" not in lines[-1]
    assert max(len(x) for x in lines) < 200


def test_default_every_gives_about_twenty_lines_and_close_writes_the_rest():
    out = io.StringIO()
    with progress(1000, desc="x", file=out, initial=500) as bar:  # a resumed run: starts at 500
        for _ in range(333):
            bar.update(1)
    lines = out.getvalue().splitlines()
    assert bar.every == 50
    assert len(lines) == 7  # 550, 600, ..., 800, then 833 at close
    assert lines[0].startswith("x: 550/1000") and lines[-1].startswith("x: 833/1000")
    out2 = io.StringIO()
    bar = progress(None, file=out2, every=3)  # unknown total
    bar.update(7)
    bar.set_postfix_str("dense")
    bar.close()
    assert out2.getvalue().splitlines() == ["7, 0s"]  # written at update (7 // 3 > 0); nothing new at close


def test_terminal_gets_tqdm_and_disabled_gets_nothing(capsys):
    from tqdm.auto import tqdm

    out = _Tty()
    bar = progress(5, desc="d", file=out)
    assert isinstance(bar, tqdm)
    bar.update(5)
    bar.close()
    assert "5/5" in out.getvalue()
    quiet = progress(5, enabled=False)
    assert isinstance(quiet, NullProgress)
    quiet.update(3)
    quiet.close()
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="every must be an int >= 1, got 0"):
        progress(5, file=io.StringIO(), every=0)


def test_one_bar_continues_over_segments_and_counts_time_from_the_start(monkeypatch):
    """A run trained in segments (the demo's validated retrofits, ``--auto``'s trials) shows one bar: the
    second segment's ``progress`` call continues the first's, its elapsed time counts from the job's start,
    and only the scope's end closes it."""
    import io

    import kvpop.progress as P

    clock = [100.0]
    monkeypatch.setattr(P.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    with P.one_bar():
        for seg in range(2):  # two segments of 5 steps of a 10-step run, 10 s a step
            bar = P.progress(10, initial=5 * seg, desc="kvpop train", every=5, file=out)
            for _ in range(5):
                clock[0] += 10
                bar.update(1)
            bar.close()  # a segment's close does not end the job's bar
    lines = out.getvalue().splitlines()
    assert lines == ["kvpop train: 5/10 (50%), 50s, ETA 50s", "kvpop train: 10/10 (100%), 100s"]
    assert P.progress(3, file=out).__class__ is P.LineProgress  # outside the scope: a bar of its own again
