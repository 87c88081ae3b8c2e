"""The per-request seq check proves loss and duplication, vectorised over the batch."""

import threading

import numpy as np

from mtpserve.ipc import wire
from mtpserve.ipc.seq_tracker import SeqTracker
from mtpserve.ipc.token_frame import TokenFrame


def out(req_ids, seq, num_tokens, finish=None) -> TokenFrame:
    b = len(req_ids)
    n = int(np.sum(num_tokens))
    return TokenFrame(wire.Kind.TARGET, 0, 0, np.array(req_ids, np.int64), np.array(seq, np.uint32),
                      np.array(num_tokens, np.int32),
                      np.array(finish if finish is not None else [0] * b, np.int32),
                      np.zeros(n, np.int32), None, None, None, None, None)


def test_consecutive_frames_pass():
    t = SeqTracker()
    assert t.check(out([7, 3], [0, 0], [2, 1])).all()
    assert t.check(out([3, 7, 9], [1, 2, 0], [4, 1, 3])).all()
    assert len(t) == 3


def test_a_lost_frame_is_flagged_once_then_resynchronised():
    t = SeqTracker()
    t.check(out([1], [0], [2]))
    assert not t.check(out([1], [4], [2]))[0]  # tokens 2..3 never arrived
    assert t.check(out([1], [6], [1]))[0]


def test_a_duplicated_frame_and_a_repeated_row_are_flagged():
    t = SeqTracker()
    t.check(out([1, 2], [0, 0], [2, 2]))
    assert t.check(out([1, 2], [0, 0], [2, 2])).tolist() == [False, False]
    assert t.check(out([5, 5], [0, 0], [1, 1])).tolist() == [True, False]


def test_unknown_requests_must_start_at_zero_unless_expected():
    t = SeqTracker()
    assert not t.check(out([4], [3], [1]))[0]
    t.expect(8, 1)  # decode instance: the first token came from prefill
    assert t.check(out([8], [1], [2]))[0]


def test_expect_and_forget_from_another_thread_apply_at_the_next_check():
    t = SeqTracker()
    t.check(out([1], [0], [1]))
    worker = threading.Thread(target=lambda: (t.expect(8, 1), t.expect(9, 1), t.forget(9)))
    worker.start()
    worker.join()
    assert len(t) == 2  # 1 and 8; 9 was refused by the engine and forgotten
    assert t.check(out([1, 8], [1, 1], [1, 1])).all()


def test_finished_requests_are_forgotten_preempted_ones_kept():
    t = SeqTracker()
    t.check(out([1, 2], [0, 0], [1, 1], finish=[wire.Finish.STOP, wire.Finish.PREEMPTED]))
    assert len(t) == 1
    assert t.check(out([2], [1], [1]))[0]


def test_a_repeated_batch_takes_the_fast_path_and_stays_exact():
    """Steady decoding (same batch every frame) and then a change of batch agree with the table."""
    t = SeqTracker()
    assert t.check(out([1, 2], [0, 0], [2, 1])).all()
    assert t.check(out([1, 2], [2, 1], [1, 1])).all()  # hot
    assert t.check(out([1, 2], [3, 2], [1, 1])).all()  # hot
    assert t.check(out([1, 2], [4, 9], [1, 1])).tolist() == [True, False]  # a loss on the hot path
    assert t.check(out([2, 3], [10, 0], [1, 1])).all()  # new batch: counts came back from hot
    t.expect(9, 4)
    assert t.check(out([1, 9], [5, 4], [1, 1], finish=[wire.Finish.STOP, 0])).all()
    assert len(t) == 3  # 1 finished; 2, 3, 9 live
