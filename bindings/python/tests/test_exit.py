"""A program exiting while its daemon threads route through a router with a replica publisher:
the publisher runs on those threads, and one that asked for the GIL of a finalizing
interpreter was ended inside the library, which aborted the process (7 exits in 10). Every
run is a child process, so that an abort fails the test only."""

from __future__ import annotations

import subprocess
import sys

_PROGRAM = r"""
import threading
import time

import kvrouter

router = kvrouter.Router(block_size=16)
router.add_worker(1)
published = []
router.set_replica_publisher("exiting", published.append)


def book_and_free(thread):
    i = 0
    while True:
        i += 1
        request_id = "t%d-%d" % (thread, i)
        router.add_request(list(range(64)), 1, request_id=request_id)
        router.free_request(request_id)


for thread in range(4):
    threading.Thread(target=book_and_free, args=(thread,), daemon=True).start()
while len(published) < 100:  # the threads are publishing
    time.sleep(0.001)
"""


def test_exiting_while_daemon_threads_publish_does_not_abort():
    for run in range(8):
        child = subprocess.run(
            [sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=120
        )
        assert child.returncode == 0, (run, child.returncode, child.stderr[-2000:])


_SUB_INTERPRETER = r"""
import threading

import kvrouter

try:
    import _testcapi
except ImportError:
    print("no sub-interpreters")
    raise SystemExit(0)
# A legacy sub-interpreter (as mod_wsgi's): the package refuses to run there. Before, it
# replaced the main interpreter's error classes with its own, dead once it ended, and its exit
# closed the publishers' gate for the whole process.
_testcapi.run_in_subinterp(
    "try:\n"
    "    import kvrouter\n"
    "    print('imported in a sub-interpreter')\n"
    "except ImportError as e:\n"
    "    print('refused:', e)\n"
)
router = kvrouter.Router(block_size=16)
router.add_worker(1)
try:
    router.add_worker(1)
except kvrouter.AlreadyExistsError:
    print("error classes intact")
publishers = []  # the thread each change was published on
router.set_replica_publisher("main", lambda change: publishers.append(threading.get_ident()))
booking = threading.Thread(target=router.add_request, args=(list(range(64)), 1), kwargs={"request_id": "r"})
booking.start()
booking.join()
print("published on the booking thread", publishers.count(booking.ident))
"""


def test_a_sub_interpreter_is_refused_and_leaves_the_main_one_intact():
    child = subprocess.run(
        [sys.executable, "-c", _SUB_INTERPRETER], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
    if child.stdout.strip() == "no sub-interpreters":
        return
    lines = child.stdout.splitlines()
    assert lines[0].startswith("refused: kvrouter runs in the main interpreter only"), lines
    assert lines[1:] == ["error classes intact", "published on the booking thread 1"], lines
