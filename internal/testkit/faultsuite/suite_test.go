package faultsuite

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/report"
)

const (
	// instances share each store, each with a Guard of its own.
	instances = 3
	// workers call the Guards, one call at a time each.
	workers = 24
	// lease is short, so that renewals happen often and faults hit them;
	// operations run for up to 5*lease/6.
	lease       = 900 * time.Millisecond
	waitTimeout = 3 * time.Second
	// strandedAfter is how long after its key's outcome was first answered
	// a duplicate may still give up waiting with ErrInFlight: it re-reads
	// the record at least once a lease, woken or not, and a read may take
	// a fault's while (up to 500ms) and a loaded machine's. It stays well
	// under waitTimeout, so that a waiter deaf to the answer is counted.
	strandedAfter = lease + time.Second
	// drainFor bounds the wait for the calls still running when the load
	// stops; those unanswered by then count as stranded.
	drainFor = 20 * time.Second
)

// dialFunc opens a store connection, as go-redis and pgx take it.
type dialFunc = func(ctx context.Context, network, addr string) (net.Conn, error)

// target is a store shared by several instances, each reaching the
// servers through a network of proxies.
type target struct {
	name   string // the report's Store
	net    *network
	guards []*idempotency.Guard
	// verify reaches the servers directly, for the checks after the faults.
	verify *idempotency.Guard
}

// newTarget connects instances to upstreams, the store's servers; connect
// makes a store whose every connection dial opens. It is called on t's
// goroutine.
func newTarget(t *testing.T, name string, upstreams []string, connect func(t *testing.T, dial dialFunc) idempotency.Store) *target {
	t.Helper()
	tg := &target{name: name, net: newNetwork(t, instances, upstreams)}
	opts := idempotency.Options{Lease: lease, WaitTimeout: waitTimeout, Observer: observer{}}
	for i := range instances {
		s := connect(t, func(ctx context.Context, _, addr string) (net.Conn, error) { return tg.net.dial(ctx, i, addr) })
		tg.guards = append(tg.guards, idempotency.New(s, opts))
	}
	var d net.Dialer
	tg.verify = idempotency.New(connect(t, d.DialContext), opts)
	return tg
}

// scenario is a fault, injected while the load runs.
type scenario struct {
	name string
	// faults injects faults into n until ctx is done, and has removed them
	// all when it returns.
	faults func(ctx context.Context, n *network)
	// loadFor is how long the load runs: 2.5s unless set.
	loadFor time.Duration
	// bodySize is the size of the operations' responses: 64 bytes unless set.
	bodySize int
	// isolates says that faults cut instance 0 off the servers: its
	// duplicates cannot be answered meanwhile, so their ErrInFlight
	// answers do not count as stranded.
	isolates bool
}

// run is one scenario's load on a target.
type run struct {
	tg    *target
	sc    scenario
	scope string
	l     *ledger

	mu   sync.Mutex
	keys []string // in the order of their first call
	// verified is the call made for each key once the faults were removed.
	verified map[string]*call
}

// play runs sc's faults on tg under load, removes them, checks what every
// caller was answered and what the store kept, and reports the counts.
func (tg *target) play(t *testing.T, sc scenario) {
	tl := tg.load(t, sc).count()
	report.Add(t, report.Entry{Suite: "faults", Store: tg.name, Faults: tg.net.faults,
		Operations: tl.calls, Duplicates: tl.dups, DoubleExecutions: tl.doubles, LostCompletions: tl.lost,
		StrandedWaiters: tl.stranded, Notes: tl.notes()})
	t.Logf("%s, %s: faults %v; calls %d (duplicates %d); double executions %d, lost completions %d, stranded waiters %d; %s",
		tg.name, sc.name, tg.net.faults, tl.calls, tl.dups, tl.doubles, tl.lost, tl.stranded, tl.notes())
	for i, p := range tl.problems {
		if i == 20 {
			t.Errorf("... and %d more", len(tl.problems)-i)
			break
		}
		t.Error(p)
	}
	// A run that exercised nothing proves nothing.
	if tl.answers["executed"] == 0 || tl.dups == 0 || tl.waited == 0 || tl.renewals == 0 || tl.stepsConfirmed == 0 {
		t.Errorf("the load did not exercise the Guard: %d executed, %d duplicates, %d waited, %d renewals, %d steps recorded",
			tl.answers["executed"], tl.dups, tl.waited, tl.renewals, tl.stepsConfirmed)
	}
}

// load runs sc's faults on tg under load, removes them, and calls Do once
// more for every key, with the faults removed.
func (tg *target) load(t *testing.T, sc scenario) *run {
	if sc.loadFor == 0 {
		sc.loadFor = 2500 * time.Millisecond
	}
	if sc.bodySize == 0 {
		sc.bodySize = 64
	}
	tg.net.faults = make(map[string]int)
	r := &run{tg: tg, sc: sc, scope: t.Name(), l: newLedger()}

	ctx, stop := context.WithTimeout(t.Context(), sc.loadFor)
	defer stop()
	var faults, load sync.WaitGroup
	faults.Go(func() { sc.faults(ctx, tg.net) })
	for range workers {
		load.Go(func() {
			for ctx.Err() == nil {
				name, dup := r.pick()
				// The caller's context is the test's: a call is bounded by
				// the Guard alone, and drainFor catches one that is not.
				r.do(t.Context(), rand.IntN(instances), &call{key: name, dup: dup})
				sleep(ctx, rand.N(20*time.Millisecond))
			}
		})
	}
	faults.Wait()
	if !waitFor(&load, drainFor) {
		t.Errorf("calls still unanswered %v after the faults were removed", drainFor)
	}
	r.verify(t)
	return r
}

// pick chooses the next call's key: a new one, one of the last few
// (duplicates of calls likely still in flight), or any earlier one (a
// retry of a key most likely answered). dup says it was called before.
func (r *run) pick() (name string, dup bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := len(r.keys)
	switch p := rand.Float64(); {
	case n == 0 || p < 0.3:
		name = keyName(n)
		r.keys = append(r.keys, name)
		return name, false
	case p < 0.85:
		return r.keys[n-1-rand.IntN(min(n, 5))], true
	default:
		return r.keys[rand.IntN(n)], true
	}
}

// do calls Guard.Do for c on instance i (the verifying Guard for -1) and
// records it in the ledger.
func (r *run) do(ctx context.Context, i int, c *call) {
	g := r.tg.verify
	if c.instance = i; i >= 0 {
		g = r.tg.guards[i]
	}
	ctx = context.WithValue(ctx, callKey{}, c)
	k := idempotency.Key{Scope: r.scope, Name: c.key}
	r.l.called(c)
	res, err := g.Do(ctx, k, idempotency.FingerprintOf("charge", []byte(c.key)), func(ctx context.Context) (idempotency.Response, error) {
		return r.operate(ctx, c)
	})
	r.l.returned(c, res, err)
}

// operate is an execution of c's operation, recorded in the ledger: work,
// in steps when c's key names an operation made of steps.
func (r *run) operate(ctx context.Context, c *call) (idempotency.Response, error) {
	info, _ := idempotency.FromContext(ctx)
	e := r.l.begin(c, info.Attempt, ctx)
	// Most operations are quick; the long ones renew their lease once or
	// twice.
	work := 5*time.Millisecond + rand.N(55*time.Millisecond)
	if rand.IntN(10) < 3 {
		work = lease/3 + rand.N(lease/2)
	}
	var refs string
	if stepwise(c.key) {
		var err error
		if refs, err = r.steps(ctx, e, work/4); err != nil {
			r.l.end(e, "")
			return idempotency.Response{}, err
		}
		work -= work / 4 * time.Duration(len(stepNames))
	}
	if !sleep(ctx, work) {
		r.l.end(e, "")
		return idempotency.Response{}, context.Cause(ctx)
	}
	body := bodyOf(c.key, e.id, refs, r.sc.bodySize)
	r.l.end(e, body)
	return idempotency.Response{Status: 201, Body: []byte(body)}, nil
}

// verify calls Do once more for every key, directly and with the faults
// removed.
func (r *run) verify(t *testing.T) {
	r.mu.Lock()
	keys := slices.Clone(r.keys)
	r.mu.Unlock()
	r.verified = make(map[string]*call, len(keys))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for _, k := range keys {
		c := &call{key: k}
		r.verified[k] = c
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			r.do(t.Context(), -1, c)
		})
	}
	if !waitFor(&wg, drainFor) {
		t.Errorf("the checks' calls are still unanswered after %v", drainFor)
	}
}

// tally is what a run's faults cost, and what its load did.
type tally struct {
	calls, dups, waited, renewals, renewalFailed int
	executions, takeovers                        int
	// early counts the duplicates answered ErrInFlight before their
	// wait timed out: fail closed, but a 409 a client did not need.
	early int
	// The runs of steps' functions, those whose recording Step confirmed,
	// the results it replayed from an earlier execution, and the runs of
	// a step after its recording was confirmed (double executions too).
	stepRuns, stepsConfirmed, stepReplays, stepReruns int
	doubles, lost, wrong, stranded                    int
	// answers counts the calls by answer: executed, replayed, or the error.
	answers         map[string]int
	worst, worstErr time.Duration // the longest call, and failed call
	problems        []string      // what went wrong, call by call
}

func (tl *tally) problem(format string, args ...any) {
	tl.problems = append(tl.problems, fmt.Sprintf(format, args...))
}

func (tl *tally) notes() string {
	return fmt.Sprintf("executions %d (takeovers %d), step runs %d (recorded %d, replayed %d, run again %d), waiters %d (early ErrInFlight %d), renewals %d (failed %d), answers %v, wrong answers %d, worst call %v (failed: %v)",
		tl.executions, tl.takeovers, tl.stepRuns, tl.stepsConfirmed, tl.stepReplays, tl.stepReruns, tl.waited, tl.early,
		tl.renewals, tl.renewalFailed, tl.answers, tl.wrong, tl.worst.Round(time.Millisecond), tl.worstErr.Round(time.Millisecond))
}

// count counts, from the ledger and the calls made once the faults were
// removed, what the faults cost.
func (r *run) count() *tally {
	l := r.l
	l.mu.Lock()
	defer l.mu.Unlock()
	tl := &tally{answers: make(map[string]int), executions: len(l.execs)}
	// firstAnswer is when a success was first answered for a key;
	// answeredBy, the executions the successes named.
	firstAnswer := make(map[string]time.Time)
	answeredBy := make(map[string]map[int]bool)
	for _, c := range l.calls {
		if c.instance < 0 {
			continue
		}
		tl.calls++
		if c.dup {
			tl.dups++
		}
		if c.end.IsZero() {
			tl.stranded++
			tl.problem("a call of %s on instance %d was never answered", c.key, c.instance)
			continue
		}
		d := c.end.Sub(c.start)
		tl.worst = max(tl.worst, d)
		if c.waited > 0 {
			tl.waited++
		}
		tl.renewals += int(c.renewals.Load())
		tl.renewalFailed += int(c.renewalFailed.Load())
		switch {
		case c.err == nil:
			e, err := l.answered(c)
			if err != nil {
				tl.wrong++
				tl.problem("%s on instance %d: %v", c.key, c.instance, err)
				continue
			}
			if c.res.Replayed {
				tl.answers["replayed"]++
			} else {
				tl.answers["executed"]++
			}
			if answeredBy[c.key] == nil {
				answeredBy[c.key] = make(map[int]bool)
			}
			answeredBy[c.key][e.id] = true
			if t0, ok := firstAnswer[c.key]; !ok || c.end.Before(t0) {
				firstAnswer[c.key] = c.end
			}
		case failure(c.err) != "":
			tl.worstErr = max(tl.worstErr, d)
			tl.answers[failure(c.err)]++
			if errors.Is(c.err, idempotency.ErrInFlight) && c.waited < waitTimeout {
				tl.early++
			}
		default:
			tl.wrong++
			tl.answers["other"]++
			tl.problem("%s on instance %d failed with %v, which is none of ErrUnavailable, ErrInFlight, ErrFenced", c.key, c.instance, c.err)
		}
	}
	for _, c := range l.calls {
		if c.instance < 0 || !errors.Is(c.err, idempotency.ErrInFlight) || r.sc.isolates && c.instance == 0 {
			continue
		}
		if t0, ok := firstAnswer[c.key]; ok && c.end.Sub(t0) > strandedAfter {
			tl.stranded++
			tl.problem("a duplicate of %s on instance %d gave up waiting (ErrInFlight) %v after the key was answered", c.key, c.instance, c.end.Sub(t0))
		}
	}

	// stored is the execution whose response the store keeps, by key.
	stored := make(map[string]*execution)
	for k, c := range r.verified {
		ids := answeredBy[k]
		if c.end.IsZero() || c.err != nil {
			if len(ids) > 0 {
				tl.lost++
			}
			tl.problem("the check of %s, with the faults removed, failed: %v", k, c.err)
			continue
		}
		e, err := l.answered(c)
		switch {
		case err != nil:
			tl.wrong++
			tl.problem("the check of %s: %v", k, err)
			continue
		case len(ids) > 1:
			tl.lost++
			tl.problem("%s: callers got the responses of %d executions, %v", k, len(ids), slices.Sorted(maps.Keys(ids)))
		case len(ids) == 1 && !ids[e.id]:
			tl.lost++
			tl.problem("%s: callers got execution %v's response, the store now answers execution %d's (replayed: %v)",
				k, slices.Collect(maps.Keys(ids)), e.id, c.res.Replayed)
		}
		stored[k] = e
	}
	for _, e := range l.execs {
		if e.attempt > 1 {
			tl.takeovers++
		}
		s := stored[e.key]
		switch {
		case e.overlapped:
			tl.doubles++
			tl.problem("%s: execution %d (attempt %d) began while another execution's context was live", e.key, e.id, e.attempt)
		case s != nil && s != e && !s.call.end.IsZero() && e.start.After(s.call.end):
			tl.doubles++
			tl.problem("%s: execution %d (attempt %d) began %v after execution %d, whose response is stored, returned",
				e.key, e.id, e.attempt, e.start.Sub(s.call.end), s.id)
		}
	}
	l.countSteps(tl, stored)
	return tl
}

// sleep waits for d, and reports false if ctx was done first.
func sleep(ctx context.Context, d time.Duration) bool {
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// waitFor waits for wg, at most d, and reports whether it is done.
func waitFor(wg *sync.WaitGroup, d time.Duration) bool {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}
