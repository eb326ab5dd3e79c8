package idempotencytest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/require"
)

// takeoverAfterLeaseExpiry checks that once the owner's lease has run out, a
// claim with the record's fingerprint takes the record over: attempt 2, the
// same operation ID, a greater token, and exactly one winner among many
// concurrent claims. A claim with another fingerprint is still answered
// Mismatch. An owner whose lease ran out but whose record no claim took over
// still holds the current token and can complete the record.
func takeoverAfterLeaseExpiry(e *env) {
	fp := fingerprint("a")
	single, singleOwner := e.ownShortLease("takeover", fp)
	raced, racedOwner := e.ownShortLease("takeover-race", fp)
	late, lateOwner := e.ownShortLease("late-owner", fp)
	e.wait(e.past)

	e.requireState(idempotency.Mismatch, e.claim(request(single.Key, fingerprint("b"))),
		"claim with another fingerprint after the lease ran out")
	c := e.own(request(single.Key, fp), 2, single.OperationID, "claim after the lease ran out")
	require.Greater(e.t, c.Token, singleOwner.Token, "the takeover's token must be greater than the first owner's")
	e.requireInFlight(request(single.Key, fp), longLease, "claim after the takeover")

	reqs := racers(claimers, raced.Key, fp)
	cs := e.claimAll(reqs)
	c = cs[e.requireOneOwner(reqs, cs, "concurrent claims after the lease ran out")]
	e.requireOwner(c, 2, raced.OperationID, "the concurrent takeover")
	require.Greater(e.t, c.Token, racedOwner.Token, "the concurrent takeover's token must be greater than the first owner's")

	want := idempotency.Response{Status: http.StatusOK, Body: []byte("late but unopposed")}
	e.complete(late.Key, lateOwner.Token, want, "an owner whose lease ran out, not taken over")
	e.requireReplay(request(late.Key, fp), late.OperationID, want, "claim after the late owner completed")
}

// heartbeatExtendsLease checks that Heartbeat sets the owner's lease to the
// duration it is given, counted from the heartbeat: the record stays in
// flight past the end of the original lease, until the renewed lease runs
// out. Then a claim takes the record over, and the first owner's Heartbeat
// is fenced.
func heartbeatExtendsLease(e *env) {
	k, fp := e.key("heartbeat"), fingerprint("a")
	first := request(k, fp)
	first.Lease = e.lease
	c1 := e.own(first, 1, first.OperationID, "first claim, with a short lease")
	e.wait(e.lease / 2)
	require.NoError(e.t, e.store.Heartbeat(e.ctx, k, c1.Token, 2*e.lease), "the owner's Heartbeat")
	e.wait(e.lease)
	// The heartbeat renewed the lease for two leases' length and at least one
	// has passed since, so at most one lease is left.
	e.requireInFlight(request(k, fp), e.lease, "claim after the original lease ran out, within the renewed one")
	e.wait(e.past)
	c2 := e.own(request(k, fp), 2, first.OperationID, "claim after the renewed lease ran out")
	require.Greater(e.t, c2.Token, c1.Token, "the takeover's token must be greater than the first owner's")
	require.ErrorIs(e.t, e.store.Heartbeat(e.ctx, k, c1.Token, longLease), idempotency.ErrFenced,
		"the first owner's Heartbeat after the takeover")
}

// silenceLease is the lease of the owner whose store falls silent: long
// enough for a renewal or two on a busy machine, and for its margin
// (Lease/20, 100ms) to cover the owner's timer firing late there (a CI run
// of the whole suite under -race saw it fire 81ms late, past the 50ms
// margin of a 1s lease), short enough for the case to run in real time. The
// case always runs in real time, even when the harness moves the store's
// clock, because the Guard's lease timer follows the real clock.
const silenceLease = 2 * time.Second

// returnBound is how long Do may take to return after the operation has
// returned once the lease is lost. Do makes no store call then, so the bound
// only allows for scheduling delays.
const returnBound = 250 * time.Millisecond

// silentStore passes calls through to the store under test until silence is
// called. From then on every call blocks and then fails with ErrUnavailable:
// until its context ends, like a partitioned connection on a client that
// honours deadlines, or, with forever, until the case ends, like one on a
// client that does not. It records when the last call that succeeded was
// sent.
type silentStore struct {
	idempotency.Store
	forever bool
	caseCtx context.Context

	silent    atomic.Bool
	mu        sync.Mutex
	confirmed time.Time // when the last call that succeeded was made
}

func (s *silentStore) silence() { s.silent.Store(true) }

func (s *silentStore) lastConfirmed() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.confirmed
}

// call runs f, unless the store is silent.
func (s *silentStore) call(ctx context.Context, f func() error) error {
	if s.silent.Load() {
		done := ctx.Done()
		if s.forever {
			done = s.caseCtx.Done()
		}
		<-done
		return fmt.Errorf("%w: silent store", idempotency.ErrUnavailable)
	}
	sent := time.Now()
	err := f()
	if err == nil {
		s.mu.Lock()
		s.confirmed = sent
		s.mu.Unlock()
	}
	return err
}

func (s *silentStore) Claim(ctx context.Context, req idempotency.ClaimRequest) (c idempotency.Claim, err error) {
	err = s.call(ctx, func() error { c, err = s.Store.Claim(ctx, req); return err })
	return c, err
}

func (s *silentStore) Complete(ctx context.Context, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	return s.call(ctx, func() error { return s.Store.Complete(ctx, k, token, resp, retention) })
}

func (s *silentStore) Release(ctx context.Context, k idempotency.Key, token uint64) error {
	return s.call(ctx, func() error { return s.Store.Release(ctx, k, token) })
}

func (s *silentStore) Forget(ctx context.Context, k idempotency.Key, token uint64) error {
	return s.call(ctx, func() error { return s.Store.Forget(ctx, k, token) })
}

func (s *silentStore) Abandon(ctx context.Context, k idempotency.Key, token uint64) error {
	return s.call(ctx, func() error { return s.Store.Abandon(ctx, k, token) })
}

func (s *silentStore) Heartbeat(ctx context.Context, k idempotency.Key, token uint64, lease time.Duration) error {
	return s.call(ctx, func() error { return s.Store.Heartbeat(ctx, k, token, lease) })
}

// silentStoreStopsOwner checks that a Guard whose store stops answering
// stops its owner on its own: the operation's context ends, with ErrFenced
// as its cause, less than one lease after the last call the store confirmed
// was sent; Do returns ErrFenced right after the operation returns; and a
// second Guard on the same store becomes the owner only after the first
// owner's context has ended. The store falls silent while the operation
// runs, either before the first renewal or after it, and its silent calls
// block either until their deadline or for good.
func silentStoreStopsOwner(e *env) {
	for _, forever := range []bool{false, true} {
		for _, renewed := range []bool{false, true} {
			name := fmt.Sprintf("Blocking=%s/AfterRenewal=%v", map[bool]string{false: "UntilDeadline", true: "ForEver"}[forever], renewed)
			e.run(name, func(e *env) { e.silentOwner(forever, renewed) })
		}
	}
}

func (e *env) silentOwner(forever, renewed bool) {
	k, fp := e.key("silent"), fingerprint("a")
	silent := &silentStore{Store: e.store, forever: forever, caseCtx: e.ctx}
	a := idempotency.New(silent, idempotency.Options{Lease: silenceLease})
	b := idempotency.New(e.store, idempotency.Options{Lease: silenceLease, WaitTimeout: -1})

	var aDone atomic.Int64 // when A's context ended, in ns since the Unix epoch
	started := make(chan struct{})
	type outcome struct {
		err      error
		cause    error
		returned time.Time
	}
	aOut := make(chan outcome, 1)
	go func() {
		var cause error
		_, err := a.Do(e.ctx, k, fp, func(ctx context.Context) (idempotency.Response, error) {
			close(started)
			select {
			case <-ctx.Done():
				aDone.Store(time.Now().UnixNano())
				cause = context.Cause(ctx)
			case <-time.After(wakeTimeout):
			}
			return idempotency.Response{Status: http.StatusCreated, Body: []byte("A")}, nil
		})
		aOut <- outcome{err, cause, time.Now()}
	}()
	<-started
	if renewed {
		time.Sleep(silenceLease/3 + silenceLease/6)
	}
	silent.silence()

	// B tries to take the record every 20ms while A runs. When the harness
	// moves the store's clock, A's lease in the store cannot run out while
	// A runs, so B tries only after A has stopped and the clock has been
	// moved; on such a store the case checks A's timing alone.
	var bStarted time.Time
	bWant := idempotency.Response{Status: http.StatusCreated, Body: []byte("B")}
	tryB := func() bool {
		_, err := b.Do(e.ctx, k, fp, func(context.Context) (idempotency.Response, error) {
			bStarted = time.Now()
			return bWant, nil
		})
		if err != nil {
			require.ErrorIs(e.t, err, idempotency.ErrInFlight, "B's Do while A holds the record")
		}
		return !bStarted.IsZero()
	}
	var out outcome
	deadline := time.After(wakeTimeout)
	for gotA := false; !gotA; {
		select {
		case out = <-aOut:
			gotA = true
		case <-deadline:
			e.t.Fatalf("A's Do did not return within %v of its store falling silent", wakeTimeout)
		case <-time.After(20 * time.Millisecond):
			if e.advance == nil && tryB() {
				e.t.Fatalf("B became the owner while A's context was live")
			}
		}
	}
	aEnded := time.Unix(0, aDone.Load())
	require.NotZero(e.t, aDone.Load(), "A's context never ended")
	require.ErrorIs(e.t, out.cause, idempotency.ErrFenced, "the cause of A's context")
	require.ErrorIs(e.t, out.err, idempotency.ErrFenced, "A's Do")
	require.Less(e.t, aEnded.Sub(silent.lastConfirmed()), silenceLease,
		"A's context outlived the lease of the last call its store confirmed")
	require.Less(e.t, out.returned.Sub(aEnded), returnBound, "A's Do returned late after its operation did")

	if e.advance != nil {
		e.advance(silenceLease + 100*time.Millisecond)
	}
	end := time.Now().Add(wakeTimeout)
	for !tryB() {
		require.True(e.t, time.Now().Before(end), "B never became the owner after A stopped")
		time.Sleep(20 * time.Millisecond)
	}
	require.True(e.t, bStarted.After(aEnded), "B started %v before A's context ended", aEnded.Sub(bStarted))
	res, err := b.Do(e.ctx, k, fp, func(context.Context) (idempotency.Response, error) {
		return idempotency.Response{}, errors.New("ran again after B completed")
	})
	require.NoError(e.t, err, "Do after B completed")
	requireResponse(e.t, bWant, res.Response, "the replay after B completed")
}
