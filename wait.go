package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// waiter is a duplicate waiting for the original in flight under its key. It
// keeps three rules:
//
//   - No wake-up is lost: it subscribes before it re-reads, so a completion
//     lands before a re-read, which sees it, or after, and wakes it.
//   - The wait is bounded: it ends after Options.WaitTimeout with an error
//     matching ErrInFlight, and the request never runs beside the original.
//   - An owner that stopped renewing is taken over: a re-read is due when
//     its lease runs out, and that claim takes the record over.
//
// A waiter lives on its caller's goroutine.
type waiter struct {
	g        *Guard
	req      ClaimRequest // Watch set: the record remembers that someone waits
	op       string       // the store call that failed, for the call's Observer
	reread   *time.Timer  // when the next re-read is due without a wake-up
	sent     time.Time    // when the re-read that gave the last answer was sent
	failed   error        // the last re-read's error, when it failed
	failures int          // re-reads failed in a row
}

// wait waits for the original of req, found in flight, and returns the claim
// that ends the wait: a completion to replay, or ownership once the original
// released the record or its lease ran out. sent is when that claim was sent.
func (g *Guard) wait(ctx context.Context, req ClaimRequest, cs *callState) (c Claim, sent time.Time, err error) {
	if g.opts.WaitTimeout < 0 {
		return Claim{}, time.Time{}, ErrInFlight
	}
	select {
	case g.waiting <- struct{}{}:
		defer func() { <-g.waiting }()
	default:
		return Claim{}, time.Time{}, fmt.Errorf("%w: %d requests already waiting", ErrInFlight, cap(g.waiting))
	}
	w := &waiter{g: g, req: req}
	w.req.Watch = true
	start := time.Now()
	ctx, endWait := g.startPhase(ctx, PhaseWait, PhaseStart{Scope: req.Key.Scope})
	defer func() {
		cs.waited = time.Since(start)
		if w.op != "" {
			cs.op = w.op
		}
		endWait(err)
	}()
	wctx, cancel := context.WithTimeout(ctx, g.opts.WaitTimeout)
	defer cancel()
	wake, err := g.subscribe(wctx, req.Key)
	if err != nil {
		return Claim{}, time.Time{}, w.unsubscribed(ctx, wctx, err)
	}
	defer wake.Close()
	w.reread = time.NewTimer(g.opts.RecheckInterval)
	defer w.reread.Stop()
	return w.run(ctx, wctx, wake.C())
}

// unsubscribed is the error of a wait whose subscription failed: a wait
// that ended before the store confirmed it simply timed out.
func (w *waiter) unsubscribed(ctx, wctx context.Context, err error) error {
	if wctx.Err() != nil && ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, errCutOff) {
		return ErrInFlight
	}
	w.op = OpSubscribe
	return errors.Join(ErrInFlight, err)
}

// run re-reads the record whenever it is woken (wake) or a re-read is due,
// until the record is no longer in flight or the wait (wctx, within ctx)
// ends.
func (w *waiter) run(ctx, wctx context.Context, wake <-chan struct{}) (Claim, time.Time, error) {
	for {
		c, done, err := w.claim(ctx)
		if done {
			return c, w.sent, err
		}
		select {
		case <-wake:
		case <-w.reread.C:
		case <-wctx.Done():
			return c, w.sent, w.timedOut(ctx)
		}
	}
}

// claim re-reads the record with a claim (the same operation ID, Watch set)
// and arms the next re-read. done reports that the wait is over, with the
// claim as its answer or with err.
//
// The claim is bounded by ctx and ClaimTimeout, not by the wait's end: a
// claim cut short by the wait's deadline might still take the record on the
// server, leaving an owner nobody knows of. ClaimTimeout cuts short only a
// claim the store does not answer, and the next re-read, with the same
// operation ID, finds such a claim again on Redis; its lease then counts
// from the earliest unanswered send, the server's deadline being that
// send's.
func (w *waiter) claim(ctx context.Context) (c Claim, done bool, err error) {
	if w.failed == nil {
		w.sent = time.Now()
	}
	c, err = w.g.claimOnce(ctx, w.req)
	switch {
	case err != nil && (ctx.Err() != nil || !errors.Is(err, ErrUnavailable)):
		w.op = OpClaim
		return c, true, errors.Join(ErrInFlight, err)
	case err != nil:
		// A re-read the store could not answer (a connection reset, a
		// reply lost) is tried again until the wait ends. The original is
		// known to be running, so the error always matches ErrInFlight.
		w.failed = err
		w.reread.Reset(w.g.retryDelay(w.failures))
		w.failures++
	case c.State == Mismatch:
		return c, true, ErrMismatch
	case c.State != InFlight:
		return c, true, nil
	default:
		w.failed, w.failures = nil, 0
		// An owner that stopped renewing is taken over as soon as its
		// lease runs out, rather than at the next regular re-read.
		w.reread.Reset(min(w.g.opts.RecheckInterval, c.LeaseLeft+time.Millisecond))
	}
	return c, false, nil
}

// timedOut is the error of a wait that ended before the original did.
func (w *waiter) timedOut(ctx context.Context) error {
	switch {
	case ctx.Err() != nil:
		return ctx.Err()
	case w.failed != nil:
		w.op = OpClaim
		return errors.Join(ErrInFlight, w.failed)
	}
	return ErrInFlight
}

// subscribe subscribes to k's wake-ups for a wait that ends with wctx. A
// subscription the store could not confirm (ErrUnavailable: say, its pub/sub
// connection was reset that moment) is tried again after retryDelay until
// the wait ends, as a failed re-read is, rather than answering the waiter
// ErrInFlight long before WaitTimeout.
func (g *Guard) subscribe(wctx context.Context, k Key) (Subscription, error) {
	var failed error // the last attempt's, when it failed with ErrUnavailable
	for failures := 0; ; failures++ {
		sctx, cancel := g.bounded(wctx)
		wake, err := g.store.Subscribe(sctx, k)
		cancel()
		err = g.cutOff(wctx, sctx, "subscribe", err)
		switch {
		case err == nil:
			return wake, nil
		case wctx.Err() != nil && failed != nil:
			// The wait ended during a retry: the store's failure is the
			// answer, not the wait's end.
			return nil, failed
		case wctx.Err() != nil || !errors.Is(err, ErrUnavailable):
			return nil, err
		}
		failed = err
		retry := time.NewTimer(g.retryDelay(failures))
		select {
		case <-retry.C:
		case <-wctx.Done():
			retry.Stop()
			return nil, err
		}
	}
}

// retryDelay is how long a waiter waits before it tries again a re-read or
// a subscription that failed failures+1 times in a row: rereadBackoff,
// doubling with each failure up to 16 times itself, and never more than
// RecheckInterval.
func (g *Guard) retryDelay(failures int) time.Duration {
	return min(g.opts.RecheckInterval, rereadBackoff<<min(failures, 4))
}

const rereadBackoff = 50 * time.Millisecond
