// Package linearizable checks that an idempotency.Store is linearizable: that
// however its clients' calls overlap, each record answers as if the calls
// had run one at a time, in an order that keeps every call between its start
// and its return, through the state machine the Store interface states.
// Check runs a randomized concurrent history against a store and checks it
// with porcupine against a small sequential model of one record (model.go).
//
// It is a module of its own, so that the library's go.mod does not gain
// porcupine. A store written by a user is checked as the library's are:
//
//	func TestLinearizable(t *testing.T) {
//		linearizable.Check(t, newStore(t), linearizable.Options{})
//	}
package linearizable

import (
	"cmp"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/idempotency-go/idempotency"
)

// Options configures Check. The zero value of every field is its documented
// default.
type Options struct {
	// Duration is how long the clients call the store. Default 2s.
	Duration time.Duration
	// Clients is how many goroutines call the store at once. Default 6.
	Clients int
	// Keys is how many records the clients share at a time. Default 3.
	Keys int
	// Skew widens each call's window, in which the store's clock may have
	// read any time, by this much on both sides: room for the clock's
	// granularity and for its drift from this process's clock over a few
	// leases. Default 5ms.
	Skew time.Duration
	// CheckTimeout bounds the linearizability check; one that does not end
	// in time fails t. Default 10s.
	CheckTimeout time.Duration
}

func (o Options) withDefaults() Options {
	o.Duration = positiveOr(o.Duration, 2*time.Second)
	o.Clients = positiveOr(o.Clients, 6)
	o.Keys = positiveOr(o.Keys, 3)
	o.Skew = positiveOr(o.Skew, 5*time.Millisecond)
	o.CheckTimeout = positiveOr(o.CheckTimeout, 10*time.Second)
	return o
}

func positiveOr[T int | time.Duration](v, def T) T {
	if v <= 0 {
		return def
	}
	return v
}

// Result is what Check checked.
type Result struct {
	// Operations counts the store calls in the history.
	Operations int
	// UnknownOutcomes counts the calls among them that failed with
	// ErrUnavailable, which the check lets have taken effect or not.
	UnknownOutcomes int
	// Records counts the records the calls were made on; each is checked
	// on its own.
	Records int
	// StepCalls counts the calls among them that saved or read recovery
	// points: none unless the store is an idempotency.RecoveryPointStore.
	StepCalls int
	// Verdict is porcupine.Ok when the history is linearizable,
	// porcupine.Illegal when it is not, and porcupine.Unknown when the check
	// ran out of Options.CheckTimeout.
	Verdict porcupine.CheckResult
}

// Check runs a history of concurrent calls against store for opts.Duration,
// then checks that it is linearizable, and fails t, naming a visualization
// of the history, if it is not or if the check does not end within
// opts.CheckTimeout. It also fails t for each error that is neither
// ErrUnavailable nor, from an owner's call, ErrFenced.
//
// Its clients act as Guards would: they claim a few keys, with duplicates
// and now and then a different fingerprint, and leases of 50 to 200ms; as
// owners they renew, complete, release, forget or abandon, or stall past
// their lease and complete late; while a record is in flight they re-claim
// it as waiters do. Takeovers, fenced calls and replays follow. A record
// once completed is replaced by a new key. When store is an
// idempotency.RecoveryPointStore, owners also save the recovery points of
// steps, sometimes twice or out of order, and read them, takeovers first.
//
// A call that fails with ErrUnavailable may or may not have taken effect, at
// any time after it started: Check holds it to that and no more, so faults
// may be injected into the store's link while it runs. store must judge
// leases by a clock that runs at the rate of this process's monotonic clock,
// give or take opts.Skew, and keep records for an hour.
//
// Check fails t with Errorf, never FailNow, so it may run on a goroutine
// other than the test's.
func Check(t testing.TB, store idempotency.Store, opts Options) Result {
	t.Helper()
	opts = opts.withDefaults()
	h := run(t.Context(), store, opts)
	for _, err := range h.breaches {
		t.Errorf("linearizable: %v: not ErrUnavailable, as every error but an owner's ErrFenced must be", err)
	}

	verdict, info := porcupine.CheckOperationsVerbose(model, h.ops, opts.CheckTimeout)
	res := Result{Operations: len(h.ops), Records: len(model.Partition(h.ops)), Verdict: verdict}
	answers := map[string]int{}
	for _, op := range h.ops {
		a := answer(op.Input.(input), op.Output.(output))
		answers[a]++
		if strings.HasSuffix(a, " unknown") {
			res.UnknownOutcomes++
		}
		if v := op.Input.(input).verb; v == save || v == points {
			res.StepCalls++
		}
	}
	var tally []string
	for _, a := range slices.Sorted(maps.Keys(answers)) {
		tally = append(tally, fmt.Sprintf("%s %d", a, answers[a]))
	}
	t.Logf("linearizable: %d calls on %d records, %d of unknown outcome, %d on recovery points: %s\n(%s)",
		res.Operations, res.Records, res.UnknownOutcomes, res.StepCalls, verdict, strings.Join(tally, ", "))

	if verdict == porcupine.Ok {
		return res
	}
	// The visualization is for a browser; a CI log gets the calls of one
	// record that fails, in the order they started.
	for _, part := range model.Partition(h.ops) {
		if porcupine.CheckOperationsTimeout(model, part, opts.CheckTimeout) == porcupine.Illegal {
			t.Logf("linearizable: the calls on %s, which are not linearizable:\n%s", part[0].Input.(input).key, listing(part, func(op porcupine.Operation) string { return describeCall(op.Input.(input), op.Output.(output)) }))
			break
		}
	}
	path := filepath.Join(t.ArtifactDir(), "linearizability.html")
	if err := porcupine.VisualizePath(model, info, path); err != nil {
		t.Errorf("linearizable: writing the visualization: %v", err)
	}
	what := "is not linearizable"
	if verdict == porcupine.Unknown {
		what = fmt.Sprintf("could not be checked within %v", opts.CheckTimeout)
	}
	t.Errorf("linearizable: the history of %d calls %s; its visualization is %s (go test -artifacts keeps it)",
		res.Operations, what, path)
	return res
}

// answer names the kind of a call's answer, for the log.
func answer(in input, out output) string {
	return in.verb.String() + " " + kind(in, out)
}

// kind is what a call's answer was: unknown, fenced, ok, or for a claim
// takeover, owner, in flight, completed or mismatch.
func kind(in input, out output) string {
	switch {
	case out.unknown:
		return "unknown"
	case out.fenced:
		return "fenced"
	case in.verb != claim:
		return "ok"
	case out.state == idempotency.Owner && out.attempt > 1:
		return "takeover"
	case out.state == idempotency.Owner:
		return "owner"
	case out.state == idempotency.InFlight:
		return "in flight"
	case out.state == idempotency.Completed:
		return "completed"
	}
	return "mismatch"
}

// listing writes ops one a line, by start: client, window, and the call
// and answer as describe tells them.
func listing(ops []porcupine.Operation, describe func(porcupine.Operation) string) string {
	ops = slices.Clone(ops)
	slices.SortFunc(ops, func(a, b porcupine.Operation) int { return cmp.Compare(a.Call, b.Call) })
	var b strings.Builder
	for _, op := range ops {
		ret := time.Duration(op.Return).String()
		if op.Return == never {
			ret = "never"
		}
		fmt.Fprintf(&b, "client %d [%v, %s] %s\n", op.ClientId, time.Duration(op.Call), ret,
			describe(op))
	}
	return b.String()
}
