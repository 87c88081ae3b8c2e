import threading
import time

import pytest

from mtpserve.engine.device_stream import DeviceStream


def test_work_runs_in_submission_order_on_one_thread():
    stream = DeviceStream()
    seen = []
    futures = [stream.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i)
               for i in range(20)]
    assert [f.result() for f in futures] == list(range(20))
    assert [i for i, _ in seen] == list(range(20))
    assert {name for _, name in seen} == {"device"} and threading.current_thread().name != "device"
    stream.close()


def test_busy_time_counts_execution_and_errors_reach_the_waiter():
    stream = DeviceStream()
    stream.submit(time.sleep, 0.05).result()

    def fail():
        raise RuntimeError("device fault")

    with pytest.raises(RuntimeError, match="device fault"):
        stream.submit(fail).result()
    assert 0.05 <= stream.busy_seconds() < 1.0
    stream.close()
    stream.close()  # idempotent
