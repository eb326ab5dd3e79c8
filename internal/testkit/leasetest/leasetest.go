// Package leasetest checks an owner's lease discipline against a real store
// over a faulty network: an owner A whose link to the store goes
// silent or slow must stop before anyone else can own its record, and must
// not give the record up while its renewals still get through. A reaches
// the store through a faultproxy; its rival B, directly.
//
// The Redis and PostgreSQL tests share these scenarios; each brings a Rig
// that knows how to connect A to its store through a proxy.
package leasetest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
)

const (
	// How many owners a scenario loses, or keeps, at once, each on a key, a
	// proxy and a client of its own.
	lostTrials, keptTrials = 20, 5
	// poll is how often B tries to take the record.
	poll = 20 * time.Millisecond
	// giveUp bounds A's operation, so that a lease that is never lost
	// cannot hang the test.
	giveUp = 20 * time.Second
	// doSlack is how soon after its context is done A's Do must return: it
	// must not wait for a store that does not answer.
	doSlack = 250 * time.Millisecond
)

// Link is A's way to the store for one trial.
type Link struct {
	Store idempotency.Store
	// Proxy carries A's connections to the server that holds the trial's
	// key; faults are injected there.
	Proxy *faultproxy.Proxy
	// Dials reports how many connections A's client has opened so far.
	Dials func() int
}

// Rig is a store under test.
type Rig struct {
	Name string
	// B is the rival's store, connected directly. It is shared by every
	// trial, as the keys differ.
	B idempotency.Store
	// A connects, for the trial on k, an owner's store through a proxy of
	// its own, which ends with t. It is called on t's goroutine.
	A func(t *testing.T, k idempotency.Key) Link
}

// linkFault is done to A's link while A's operation runs.
type linkFault struct {
	Name   string
	Inject func(*faultproxy.Proxy)
	// Reconnects says that A's client cannot get past the fault without
	// opening a new connection.
	Reconnects bool
}

// partition makes A's link silent for good.
var partition = linkFault{Name: "partition", Inject: (*faultproxy.Proxy).Partition}

// latency delays every chunk on A's link by d each way.
func latency(d time.Duration) linkFault {
	return linkFault{Name: "latency-" + d.String(), Inject: func(p *faultproxy.Proxy) { p.SetLatency(d) }}
}

// resetOnNextRequest resets the connection of A's next request, after the
// server applied it (forward) or before it saw it.
func resetOnNextRequest(forward bool) linkFault {
	name := map[bool]string{true: "reset-after-apply", false: "reset-before-apply"}[forward]
	return linkFault{Name: name, Inject: func(p *faultproxy.Proxy) { p.ResetOnNextRequest(forward) }, Reconnects: true}
}

// Partitions runs the partition scenario with leases of 1s and
// 3s: see lost.
func Partitions(t *testing.T, rig Rig) {
	for _, lease := range []time.Duration{time.Second, 3 * time.Second} {
		t.Run(lease.String(), func(t *testing.T) { lost(t, rig, lease, partition) })
	}
}

// LinkFaults runs, with a 1s lease, the faults of A's link that must not
// cost A its record (round trips either side of Lease/3, a reset during a
// renewal, before or after the store applied it: see kept), and a latency
// that must (a round trip above the lease: see lost).
func LinkFaults(t *testing.T, rig Rig) {
	const lease = time.Second
	// Armed 50ms before the second renewal, well after the operation's
	// first calls, so that the next request on the link is a renewal.
	const beforeRenewal = 2*lease/3 - 50*time.Millisecond
	for _, c := range []struct {
		fault      linkFault
		at, runFor time.Duration
	}{
		{latency(150 * time.Millisecond), 0, 5 * lease / 2}, // a round trip of 300ms
		{latency(180 * time.Millisecond), 0, 5 * lease / 2}, // 360ms
		{resetOnNextRequest(true), beforeRenewal, 2 * lease},
		{resetOnNextRequest(false), beforeRenewal, 2 * lease},
	} {
		t.Run(c.fault.Name, func(t *testing.T) { kept(t, rig, lease, c.fault, c.at, c.runFor) })
	}
	slow := latency(700 * time.Millisecond)
	t.Run(slow.Name, func(t *testing.T) { lost(t, rig, lease, slow) })
}

// lost runs owners that lose their lease to fault, injected right after
// their operation starts, or in every other trial after their first
// renewal. Each operation waits for its context to be done. It checks, for
// every trial, that B becomes the owner only after A's context is done; that
// A's Do returns promptly then, with ErrFenced, as its context's cause is;
// and that B's outcome is the one kept. It logs the spread of the timings.
func lost(t *testing.T, rig Rig, lease time.Duration, fault linkFault) {
	trials := play(t, rig, lease, fault, lostTrials, func(i int) time.Duration {
		if i%2 == 1 {
			return lease/3 + 50*time.Millisecond
		}
		return 0
	}, giveUp)

	expect(t, trials, "A's context is done", func(tr *trial) string {
		return unless(!tr.ctxDone.IsZero(), "it never was, Do returned after %v: %v", tr.returned.Sub(tr.started), tr.err)
	})
	expect(t, trials, "B becomes the owner", func(tr *trial) string {
		return unless(!tr.bStarted.IsZero(), "it never did, in %d tries", tr.bTries)
	})
	expect(t, trials, "B starts after A's context is done", func(tr *trial) string {
		switch {
		case tr.bStarted.IsZero():
			return ""
		case tr.ctxDone.IsZero():
			return fmt.Sprintf("B started %v after the fault, and A's context was never done", tr.bStarted.Sub(tr.faulted))
		}
		return unless(tr.bStarted.After(tr.ctxDone), "B started %v before", tr.ctxDone.Sub(tr.bStarted))
	})
	expect(t, trials, fmt.Sprintf("A's Do returns within %v of its context being done", doSlack), func(tr *trial) string {
		if tr.ctxDone.IsZero() {
			return ""
		}
		return unless(tr.returned.Sub(tr.ctxDone) <= doSlack, "it took %v", tr.returned.Sub(tr.ctxDone))
	})
	expect(t, trials, "A's Do fails with ErrFenced", func(tr *trial) string {
		return unless(errors.Is(tr.err, idempotency.ErrFenced), "it returned %v", tr.err)
	})
	expect(t, trials, "the cause of A's context is ErrFenced", func(tr *trial) string {
		return unless(tr.ctxDone.IsZero() || errors.Is(tr.cause, idempotency.ErrFenced), "it is %v", tr.cause)
	})
	expectB(t, trials)
	expectReplay(t, trials, "B")

	var gap, stop, ret, took []time.Duration
	for _, tr := range trials {
		if !tr.bStarted.IsZero() && !tr.faulted.IsZero() {
			took = append(took, tr.bStarted.Sub(tr.faulted))
		}
		if !tr.ctxDone.IsZero() {
			if !tr.faulted.IsZero() {
				stop = append(stop, tr.ctxDone.Sub(tr.faulted))
			}
			ret = append(ret, tr.returned.Sub(tr.ctxDone))
			if !tr.bStarted.IsZero() {
				gap = append(gap, tr.bStarted.Sub(tr.ctxDone))
			}
		}
	}
	t.Logf("%s, lease %v, %s: %d trials; gap tB-tA %s; tA-fault %s; tDo-tA %s; tB-fault %s",
		rig.Name, lease, fault.Name, len(trials), spread(gap), spread(stop), spread(ret), spread(took))
}

// kept runs owners whose operation lasts runFor, with fault injected at
// after it starts. It checks that the fault costs them nothing: each Do
// succeeds, its context is never done early, B never becomes the owner,
// and A's outcome is the one kept.
func kept(t *testing.T, rig Rig, lease time.Duration, fault linkFault, at, runFor time.Duration) {
	trials := play(t, rig, lease, fault, keptTrials, func(int) time.Duration { return at }, runFor)

	expect(t, trials, "A's Do succeeds with its own response", func(tr *trial) string {
		return unless(tr.err == nil && !tr.res.Replayed && string(tr.res.Response.Body) == "A",
			"it returned %v, %+v; new connections of A's client during the fault: %d", tr.err, tr.res, tr.dialsAfter-tr.dialsBefore)
	})
	expect(t, trials, "A's context is not done before the operation ends", func(tr *trial) string {
		return unless(tr.ctxDone.IsZero(), "it was done %v after the fault, cause %v; new connections of A's client meanwhile: %d",
			tr.ctxDone.Sub(tr.faulted), tr.cause, tr.dialsAfter-tr.dialsBefore)
	})
	expect(t, trials, "B never becomes the owner", func(tr *trial) string {
		return unless(tr.bStarted.IsZero(), "it did, %v after the fault", tr.bStarted.Sub(tr.faulted))
	})
	expect(t, trials, "B tried while A ran", func(tr *trial) string {
		return unless(tr.bTries > 0, "it did not")
	})
	expectB(t, trials)
	expectReplay(t, trials, "A")
	if fault.Reconnects {
		expect(t, trials, "the fault made A's client reconnect", func(tr *trial) string {
			return unless(tr.dialsAfter > tr.dialsBefore, "it opened no new connection: the fault did not fire")
		})
	}
}

// trial is one owner A and its rival B on one key. Every field is written
// by the goroutines of play, and read after they ended.
type trial struct {
	k    idempotency.Key
	link Link
	at   time.Duration // when the fault is injected, after A's operation started

	started, faulted, ctxDone, returned, bStarted time.Time
	cause, err                                    error
	res                                           idempotency.Result
	dialsBefore, dialsAfter                       int
	bTries                                        int
	bErrs                                         []error // B's answers other than ErrInFlight
	replay                                        idempotency.Result
	replayErr                                     error
}

var fp = idempotency.FingerprintOf("lease", nil)

// play runs n trials at once and returns them once every one has ended.
// Trial i injects fault at(i) after A's operation starts; the operation
// returns A's response after runFor unless its context is done first.
func play(t *testing.T, rig Rig, lease time.Duration, fault linkFault, n int, at func(i int) time.Duration, runFor time.Duration) []*trial {
	b := idempotency.New(rig.B, idempotency.Options{Lease: lease, WaitTimeout: -1})
	trials := make([]*trial, n)
	for i := range trials {
		k := idempotency.Key{Scope: "lease", Name: fmt.Sprintf("%s-%v-%d", fault.Name, lease, i)}
		trials[i] = &trial{k: k, link: rig.A(t, k), at: at(i)}
	}
	done := make(chan struct{})
	for _, tr := range trials {
		go func() {
			defer func() { done <- struct{}{} }()
			tr.play(idempotency.New(tr.link.Store, idempotency.Options{Lease: lease}), b, fault, runFor, 2*lease)
		}()
	}
	for range trials {
		<-done
	}
	return trials
}

// play runs A's operation, B's attempts to take the record over while it
// runs and for up to bWait after A's Do returned, and then a Do that must
// replay the record's outcome.
func (tr *trial) play(a, b *idempotency.Guard, fault linkFault, runFor, bWait time.Duration) {
	ctx := context.Background()
	started, returned := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(returned)
		tr.res, tr.err = a.Do(ctx, tr.k, fp, func(ctx context.Context) (idempotency.Response, error) {
			tr.started = time.Now()
			close(started)
			select {
			case <-ctx.Done():
				tr.ctxDone, tr.cause = time.Now(), context.Cause(ctx)
				return idempotency.Response{}, tr.cause
			case <-time.After(runFor):
				return idempotency.Response{Status: 201, Body: []byte("A")}, nil
			}
		})
		tr.returned = time.Now()
	}()
	select {
	case <-started:
	case <-returned:
		return // A never ran: the checks say so
	}

	stopB, bDone := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(bDone)
		tick := time.NewTicker(poll)
		defer tick.Stop()
		for {
			_, err := b.Do(ctx, tr.k, fp, func(context.Context) (idempotency.Response, error) {
				tr.bStarted = time.Now()
				return idempotency.Response{Status: 201, Body: []byte("B")}, nil
			})
			tr.bTries++
			switch {
			case err == nil:
				return // B ran, or replayed A's outcome
			case !errors.Is(err, idempotency.ErrInFlight):
				tr.bErrs = append(tr.bErrs, err)
			}
			select {
			case <-tick.C:
			case <-stopB:
				return
			}
		}
	}()

	select {
	case <-time.After(time.Until(tr.started.Add(tr.at))):
		tr.dialsBefore = tr.link.Dials()
		fault.Inject(tr.link.Proxy)
		tr.faulted = time.Now()
	case <-returned:
	}
	select {
	case <-returned:
	case <-time.After(giveUp + 5*time.Second):
		// A's Do waits for a store that will never answer. Resetting every
		// connection makes each call blocked on one fail at once.
		tr.link.Proxy.Heal()
		tr.link.Proxy.ResetAll()
		<-returned
	}
	tr.dialsAfter = tr.link.Dials()
	select {
	case <-bDone:
	case <-time.After(bWait):
	}
	close(stopB)
	<-bDone
	// A's pool and client close at the end of the test: none of their
	// connections may stay stuck in a partition.
	tr.link.Proxy.Heal()

	tr.replay, tr.replayErr = b.Do(ctx, tr.k, fp, func(context.Context) (idempotency.Response, error) {
		return idempotency.Response{}, errors.New("the operation ran again")
	})
}

// expectB checks that B's every attempt before it owned the record found it
// in flight.
func expectB(t *testing.T, trials []*trial) {
	t.Helper()
	expect(t, trials, "B's attempts find the record in flight", func(tr *trial) string {
		return unless(len(tr.bErrs) == 0, "%d failed otherwise, first: %v", len(tr.bErrs), errors.Join(tr.bErrs...))
	})
}

// expectReplay checks that a Do after the trial replays body, the outcome of
// the owner that should have kept the record.
func expectReplay(t *testing.T, trials []*trial, body string) {
	t.Helper()
	expect(t, trials, "a later Do replays "+body+"'s response", func(tr *trial) string {
		return unless(tr.replayErr == nil && tr.replay.Replayed && string(tr.replay.Response.Body) == body,
			"it returned %v, %+v", tr.replayErr, tr.replay)
	})
}

// expect reports, in one error, the trials for which bad says why what is
// not so.
func expect(t *testing.T, trials []*trial, what string, bad func(*trial) string) {
	t.Helper()
	var fails []string
	for i, tr := range trials {
		if why := bad(tr); why != "" {
			fails = append(fails, fmt.Sprintf("trial %d (fault at +%v): %s", i, tr.at, why))
		}
	}
	if len(fails) > 0 {
		const shown = 5
		t.Errorf("%s: not so in %d of %d trials:\n\t%s", what, len(fails), len(trials), strings.Join(fails[:min(len(fails), shown)], "\n\t"))
	}
}

// unless returns "" when ok, and otherwise the reason formatted.
func unless(ok bool, format string, args ...any) string {
	if ok {
		return ""
	}
	return fmt.Sprintf(format, args...)
}

// spread summarises durations as min/median/max.
func spread(ds []time.Duration) string {
	if len(ds) == 0 {
		return "none"
	}
	slices.Sort(ds)
	r := func(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
	return fmt.Sprintf("min %v median %v max %v (n=%d)", r(ds[0]), r(ds[len(ds)/2]), r(ds[len(ds)-1]), len(ds))
}
