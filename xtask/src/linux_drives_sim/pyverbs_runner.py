# Runs rdma-core's Python test suite (Debian's python3-pyverbs tests) inside the UML guest of
# `cargo xtask linux-drives-sim --python`, one child process per test module, and writes one JSON line per test.
#
# A child that dies or hangs costs only the test it was running: that test is recorded as an error with why
# (the exit status or the timeout), and a new child runs the module's remaining tests.
#
#   runner.py --tests DIR --dev mlx5_0 --out FILE [--gid N] [--timeout S] [--child ID...]

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time


def child(args):
    """Runs the given test ids in this process; reports each on --report-fd, one JSON object a line."""
    import unittest
    from importlib.machinery import SourceFileLoader

    report = os.fdopen(args.report_fd, "w", buffering=1)

    def emit(**kw):
        report.write(json.dumps(kw) + "\n")
        report.flush()

    sys.path.insert(0, args.tests)
    sys.argv = [sys.argv[0], "--dev", args.dev]
    if args.gid is not None:
        sys.argv += ["--gid", str(args.gid)]
    from args_parser import parser

    parser.parse_args()
    tests = SourceFileLoader("tests", os.path.join(args.tests, "__init__.py")).load_module()

    class Result(unittest.TestResult):
        def startTest(self, test):
            super().startTest(test)
            self.t0 = time.monotonic()
            emit(event="start", id=test.id())

        def _done(self, test, status, reason=""):
            dt = time.monotonic() - getattr(self, "t0", time.monotonic())
            emit(event="done", id=test.id(), status=status, reason=reason, seconds=round(dt, 2))

        def addSuccess(self, test):
            self._done(test, "passed")

        def addSkip(self, test, reason):
            self._done(test, "skipped", str(reason))

        def addFailure(self, test, err):
            self._done(test, "failed", self._exc_info_to_string(err, test))

        def addError(self, test, err):
            self._done(test, "error", self._exc_info_to_string(err, test))

        def addExpectedFailure(self, test, err):
            self._done(test, "passed", "expected failure")

        def addUnexpectedSuccess(self, test):
            self._done(test, "failed", "unexpected success")

        def addSubTest(self, test, subtest, err):
            if err is not None:
                status = "failed" if issubclass(err[0], test.failureException) else "error"
                self._done(subtest, status, self._exc_info_to_string(err, subtest))

    suite = unittest.TestLoader().loadTestsFromNames(args.child, tests)
    suite.run(Result())
    emit(event="end")


def list_tests(args):
    out = subprocess.run(
        [sys.executable, os.path.join(args.tests, "run_tests.py"), "--dev", args.dev, "--list-tests"],
        cwd=args.tests,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    ids = [l.strip() for l in out.stdout.splitlines() if l.startswith("tests.")]
    if not ids:
        sys.stderr.write(out.stdout + out.stderr)
    return ids


def run_module(args, ids, out, log):
    """Runs `ids` (one module's tests) in children until each has a result."""
    left = list(ids)
    while left:
        r, w = os.pipe()
        cmd = [sys.executable, os.path.abspath(__file__), "--tests", args.tests, "--dev", args.dev]
        if args.gid is not None:
            cmd += ["--gid", str(args.gid)]
        cmd += ["--report-fd", str(w), "--child"] + left
        p = subprocess.Popen(
            cmd,
            cwd=args.tests,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(w,),
            start_new_session=True,
        )
        os.close(w)
        buf = b""
        current = None
        deadline = time.monotonic() + args.timeout
        why = None
        while True:
            wait = deadline - time.monotonic()
            if wait <= 0:
                why = "timeout: no result within %d s" % args.timeout
                break
            ready, _, _ = select.select([r], [], [], wait)
            if not ready:
                continue
            chunk = os.read(r, 65536)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev["event"] == "start":
                    current = ev["id"]
                    deadline = time.monotonic() + args.timeout
                    print("pyverbs: start %s" % current, flush=True)
                elif ev["event"] == "done":
                    record(out, ev["id"], ev["status"], ev["reason"], ev["seconds"])
                    if ev["id"] in left:
                        left.remove(ev["id"])
                    current = None
                elif ev["event"] == "end":
                    # No fixtures in the suite today; a test the loader found but never started still gets a line.
                    for t in left:
                        record(out, t, "error", "not run: the test process ended without starting it", None)
                    left = []
        os.close(r)
        if why is not None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = p.wait()
        # The process group's other members (a test's forked helpers) go with it.
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not left:
            break
        if why is None:
            why = "the test process died (%s)" % (
                "signal %d" % -code if code < 0 else "exit status %d" % code
            )
        if current is None:
            # It died between tests (in a class or module fixture, or at exit): charge the next one.
            current = left[0]
        record(out, current, "error", why, None)
        if current in left:
            left = left[left.index(current) + 1 :]


def record(out, tid, status, reason, seconds):
    out.write(json.dumps({"id": tid, "status": status, "reason": reason, "seconds": seconds}) + "\n")
    out.flush()
    first = reason.strip().splitlines()[-1] if reason.strip() else ""
    print("pyverbs: %s %s %s" % (status, tid, first[:200]), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tests", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--gid", type=int)
    ap.add_argument("--out")
    ap.add_argument("--log")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--only", default="")
    ap.add_argument("--report-fd", type=int)
    ap.add_argument("--child", nargs="*")
    args = ap.parse_args()
    if args.child is not None:
        child(args)
        return
    ids = list_tests(args)
    print("pyverbs: %d tests" % len(ids), flush=True)
    modules = []
    for t in ids:
        m = t.split(".")[1]
        if args.only and m not in args.only.split(","):
            continue
        if not modules or modules[-1][0] != m:
            modules.append((m, []))
        modules[-1][1].append(t)
    with open(args.out, "w") as out, open(args.log, "w") as log:
        for m, mids in modules:
            t0 = time.monotonic()
            log.write("=== %s ===\n" % m)
            log.flush()
            run_module(args, mids, out, log)
            print("pyverbs: module %s took %.1f s" % (m, time.monotonic() - t0), flush=True)
    print("pyverbs: finished", flush=True)


if __name__ == "__main__":
    main()
