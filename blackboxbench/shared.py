"""One stream of forwards for several runs of a config that share a target model (``share_forwards``).

The runs of a group take turns on the calling thread, each in its own greenlet (a coroutine with its own stack),
and each holds a :class:`Member` in place of the model. A member's call hands control back to the group, which
resumes the next run; once every run still going has asked, one forward answers all of them, their inputs
concatenated in member order (in chunks of ``chunk`` images). The model thus sees one call per round instead of
one per run: on a launch-bound GPU that divides the number of calls by the group's size, and on a CPU it merges
the small batches of the runs' tails. The interleaving is fixed (rounds in member order), so a run's records are
the same at every repetition, and equal to an unshared run's wherever the model's forward is batch-invariant. A
run that ends or fails leaves the group; the others go on.

Greenlets, not threads: the runs never compute at the same time, so their tensor work does not compete for the
CPU's cores (with one thread per run, each thread's own OpenMP team made every step slower on 2 cores than the
merged forwards saved). A switch happens only inside a member's call; torch's grad mode, which is per thread, is
restored for each run when it resumes.
"""
import torch

from .errors import BenchError

try:
    from greenlet import getcurrent, greenlet
except ImportError:  # a setup.py dependency; only a group of runs needs it, so the rest works without
    getcurrent = greenlet = None


class SharedForward:
    """The forwards of ``model`` for ``members`` runs (see the module docstring); ``calls`` counts the model's
    calls, ``rounds`` the rounds, ``asks`` each member's calls."""

    def __init__(self, model, members, chunk):
        self.model, self.chunk = model, chunk
        self.asks = [0] * members
        self.calls = self.rounds = 0

    def member(self, i):
        return Member(self, i)

    def run(self, jobs):
        """Run ``jobs`` (one callable per member, in member order) to their ends, interleaved on this thread.
        Returns one ``(result, error)`` per job (``error`` None when it returned)."""
        if greenlet is None:
            raise BenchError("share_forwards needs the greenlet package: pip install greenlet")
        grad = torch.is_grad_enabled()
        outcome = [None] * len(jobs)
        lets = [greenlet(_catching(job)) for job in jobs]
        asked = {}
        try:
            for k, let in enumerate(lets):
                self._resume(k, let, None, asked, outcome)
            while asked:
                order = sorted(asked)
                xs = [asked.pop(k) for k in order]
                for k, answer in zip(order, self._forward(xs)):
                    self._resume(k, lets[k], answer, asked, outcome)
        finally:
            torch.set_grad_enabled(grad)
        return outcome

    def _resume(self, k, let, value, asked, outcome):
        out = let.switch(value) if let else let.switch()  # a greenlet not yet started is false
        if let.dead:
            outcome[k] = out
        else:
            asked[k] = out

    def _forward(self, xs):
        """One round: the answers to ``xs`` (each the exception, if the forward fails)."""
        self.rounds += 1
        try:
            x = torch.cat(xs)
            with torch.no_grad():
                outs = []
                for s in range(0, x.shape[0], self.chunk):
                    outs.append(self.model(x[s:s + self.chunk]))
                    self.calls += 1
                out = torch.cat(outs) if outs else self.model(x)
            return list(out.split([len(v) for v in xs]))
        except Exception as e:  # noqa: BLE001  (every member of the round gets the error)
            return [e] * len(xs)


def _catching(job):
    def body():
        try:
            return job(), None
        except Exception as e:  # noqa: BLE001  (the run's error, raised by the caller after the group ends)
            return None, e
    return body


class Member:
    """A run's handle on a :class:`SharedForward`: called like the model (its parameters are the model's), from
    a job of :meth:`SharedForward.run`."""

    def __init__(self, shared, i):
        self.shared, self.i = shared, i

    def __call__(self, x):
        self.shared.asks[self.i] += 1
        grad = torch.is_grad_enabled()
        answer = getcurrent().parent.switch(x)
        torch.set_grad_enabled(grad)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def parameters(self):
        return self.shared.model.parameters()
