"""The notify protocol against a datagram socket the test owns (as systemd would own it)."""

import socket

import pytest

from mtpserve.notify import Notifier


@pytest.fixture
def notify_socket(tmp_path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    yield str(path), sock
    sock.close()


def test_messages_arrive_as_key_value_lines(notify_socket):
    path, sock = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"})
    assert notifier.ready("warm")
    assert sock.recv(4096).decode().split("\n") == ["READY=1", "STATUS=warm"]
    assert notifier.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert notifier.stopping()
    assert sock.recv(4096).decode().startswith("STOPPING=1\n")
    assert notifier.watchdog_interval_s() == 2.0


def test_abstract_socket():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0mtpserve-test-notify")
    sock.settimeout(2)
    try:
        assert Notifier({"NOTIFY_SOCKET": "@mtpserve-test-notify"}).ready()
        assert sock.recv(4096).startswith(b"READY=1")
    finally:
        sock.close()


def test_no_op_outside_systemd():
    notifier = Notifier({})
    assert not notifier.enabled
    assert not notifier.ready()
    assert notifier.watchdog_interval_s() is None


def test_send_to_a_vanished_socket_reports_failure(tmp_path):
    assert not Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}).watchdog()
