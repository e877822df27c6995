"""`make bench` (a) runs against the current protocol: the shim's channel to a real sidecar, rings on
and off, and the raw baseline each complete their round trips (a few, no timing asserted)."""

from bench.exchange import interleaved


def test_the_exchange_bench_completes_round_trips_on_every_path(tmp_path):
    samples = interleaved(4, 20, tmp_path, block=10)
    assert sorted(samples) == ["raw", "ring", "zmq"]
    for name, durations in samples.items():
        assert len(durations) >= 20 and all(d > 0 for d in durations), name
