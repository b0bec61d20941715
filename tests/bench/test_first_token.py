"""`bench.first_token` refuses a call that names nothing to time (its runs against a server and
the engine are covered end to end by tests/bench/test_serving_path.py)."""

from __future__ import annotations

import pytest

from dflash_serve.services.bench import first_token


@pytest.mark.parametrize("argv", [[], ["--grpc", "127.0.0.1:1", "--requests", "0"]])
def test_nothing_to_time_is_refused_saying_what_to_give(argv, capsys):
    with pytest.raises(SystemExit):
        first_token.main(argv)
    assert "give --embedded, or a server's --grpc and/or --http" in capsys.readouterr().err


def test_the_summary_leaves_the_warm_up_out():
    seconds = [1.0] * first_token.WARMUP + [0.001 * i for i in range(1, 11)]
    assert first_token.summary(seconds) == {"median_ms": 5.5, "p10_ms": 1.9, "p90_ms": 9.1, "requests": 10}
