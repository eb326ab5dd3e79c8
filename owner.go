package idempotency

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// leaseMargin is how much sooner than the store an owner ends its own lease:
// a twentieth of the lease, at least 10ms, and at most a quarter of the
// lease, so that a short lease still leaves time to renew. It covers a timer
// that fires late on a busy machine, the store's millisecond clock, and the
// difference in rate between the owner's clock and the store's.
func leaseMargin(lease time.Duration) time.Duration {
	return min(max(lease/20, 10*time.Millisecond), lease/4)
}

// owner is one attempt's hold on a record, from the claim that made it the
// owner to the store call that settles the record. It keeps one rule:
//
//	the operation's context is done no later than sent + Lease - margin,
//
// where sent is when the last claim or renewal that the store confirmed was
// handed to the store, read on this process's monotonic clock. The store
// starts its lease when it applies that call, which is later, so the owner
// stops before anyone else can own the record. A local timer enforces the
// rule: no store call has to return for the context to end, and every store
// call made for the owner carries that moment as its deadline.
type owner struct {
	g      *Guard
	k      Key
	c      Claim
	ctx    context.Context // the lease's: the operation runs in it
	cancel context.CancelCauseFunc
	calls  context.Context // ctx's values without its end: the store calls' parent

	mu       sync.Mutex
	deadline time.Time     // sent + Lease - margin of the last confirmed claim or renewal
	next     time.Time     // when the next renewal is due
	timer    *time.Timer   // fires at the deadline, or at next when a renewal may be sent
	renewing chan struct{} // closed when the renewal in flight returns; nil when none is
	renewed  time.Time     // when the renewal in flight was sent
	rtt      time.Duration // how long the last confirmed claim or renewal took
	settling bool          // no renewal is sent any more, but the one in flight counts
	ended    bool          // the settling call was made, or the lease was lost
	lost     error         // why the lease ended before the owner settled; matches ErrFenced
	failed   error         // the last renewal's failure, named when the lease then runs out

	// pts are the operation's recovery points (step.go), guarded by their
	// own lock, which is held across store calls.
	pts points

	// cs is what the call learns as the owner, for its Observer: the
	// disposition applied, a failed store call, and what Recover decided.
	// Written on the goroutine that runs the operation only.
	cs callState
}

// abandon is a Disposition for the Guard's own use: the owner gives its lease
// up without settling, so the record stays abandoned for the next claim.
const abandon Disposition = -1

// errPanicked ends the run phase of an operation that panicked; the panic
// itself goes on.
var errPanicked = errors.New("idempotency: the operation panicked")

// errLateClaim: the store confirmed a claim only after the lease it started
// would have run out, so the caller must not act on it.
var errLateClaim = errors.New("claim confirmed too late to act on")

// own makes the caller the owner of c, a claim sent at sent that made it
// one, and starts the lease. A claim confirmed too late to be acted on is
// given back, and own fails with ErrUnavailable: nothing ran, and a retry
// finds the record as this claim left it.
func (g *Guard) own(ctx context.Context, k Key, c Claim, sent time.Time) (*owner, error) {
	lease := g.opts.Lease
	now := time.Now()
	o := &owner{g: g, k: k, c: c, deadline: sent.Add(lease - leaseMargin(lease)), next: sent.Add(lease / 3), rtt: now.Sub(sent)}
	if !now.Before(o.deadline) {
		// Not waited for: it only spares the next claim the wait for the
		// lease, and the token keeps it harmless whenever it lands.
		go func() {
			bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), lease)
			defer cancel()
			_ = giveBack(bctx, g.store, k, c)
		}()
		return nil, fmt.Errorf("%w: %w, %v after it was sent", ErrUnavailable, errLateClaim, now.Sub(sent).Round(time.Millisecond))
	}
	// The store calls made for the owner outlive the operation's context,
	// which ends first; they keep its values.
	o.calls = context.WithoutCancel(ctx)
	if !g.opts.CancelWithCaller {
		// A caller that gives up must not abort the operation half-way:
		// the lease bounds it instead, and a retry replays its outcome.
		ctx = o.calls
	}
	o.ctx, o.cancel = context.WithCancelCause(ctx)
	g.owners.Add(1)
	o.mu.Lock()
	o.timer = time.AfterFunc(o.next.Sub(now), o.tick)
	o.mu.Unlock()
	return o, nil
}

// untouched is how an owner that acted on nothing gives the record back as
// it found it: a record its own claim made is forgotten, one whose previous
// attempt was abandoned stays abandoned (the next owner must still learn
// that an attempt may have acted), and any other is released.
func untouched(c Claim) Disposition {
	switch {
	case c.Abandoned:
		return abandon
	case c.Attempt == 1:
		return Forget
	}
	return Release
}

// giveBack gives the record of k back to s as untouched says, for the owner
// that claim c made, when it acted on nothing.
func giveBack(ctx context.Context, s Store, k Key, c Claim) error {
	return apply(ctx, s, k, c.Token, Response{}, untouched(c), 0)
}

// close ends the owner, whatever became of the record: no renewal is sent
// any more and the operation's context is done.
func (o *owner) close() {
	o.g.owners.Add(-1)
	o.end()
	o.cancel(nil)
}

// run runs fn as the owner and settles the record with its outcome. An
// abandoned record goes to Options.Recover first.
func (o *owner) run(fn func(ctx context.Context) (Response, error)) (Result, error) {
	defer o.close()
	if o.c.Abandoned && o.g.opts.Recover != nil {
		resp, d, err := o.recover()
		switch {
		case err != nil:
			return Result{}, err
		case d == Keep || d == Settled:
			return Result{Response: resp, Replayed: true, OperationID: o.c.OperationID}, nil
		}
		// The hook found that the operation never happened: run it now,
		// still under the same lease, unless the hook outlasted it.
		if err := o.lostErr(); err != nil {
			return Result{}, err
		}
	}
	resp, d, err := o.call(fn, Release, true)
	if err != nil {
		// fn's error may be the lost lease itself, from its context.
		if serr := o.settle(Response{}, Release); serr != nil && !errors.Is(err, serr) {
			err = errors.Join(err, serr)
		}
		return Result{}, err
	}
	if err := o.settle(resp, d); err != nil {
		return Result{}, err
	}
	return Result{Response: resp, OperationID: o.c.OperationID}, nil
}

// recover runs Options.Recover as the owner of an abandoned record and
// settles the record when the hook decided its outcome. A hook that found
// that the operation never happened leaves the record to the caller, still
// owned, with the disposition Release or Forget. When the hook cannot tell,
// the record is left abandoned for a later retry or sweep, and the error
// matches ErrInFlight: the operation may still have happened.
func (o *owner) recover() (Response, Disposition, error) {
	resp, d, err := o.call(o.g.opts.Recover, abandon, false)
	if err != nil {
		o.cs.unknown = true
		return Response{}, 0, errors.Join(ErrInFlight, err, o.settle(Response{}, abandon))
	}
	if d == Keep || d == Settled {
		if err := o.settle(resp, d); err != nil {
			return Response{}, 0, err
		}
		o.cs.recovered = true
	}
	return resp, d, nil
}

// call runs f under the lease, with an Info of its own in its context, and
// returns its response, the disposition chosen for it (Settled once it was
// settled early), and its error. Should f panic, the record is settled with
// onPanic before the panic goes on. With early, f may settle the record
// before it returns (see Info.settleEarly).
func (o *owner) call(f func(ctx context.Context) (Response, error), onPanic Disposition, early bool) (Response, Disposition, error) {
	c := o.c
	info := &Info{OperationID: c.OperationID, Attempt: c.Attempt, Token: c.Token, Takeover: c.Attempt > 1, Abandoned: c.Abandoned,
		owner: o, early: early}
	returned := false
	defer func() {
		if !returned && !info.settled {
			_ = o.settle(Response{}, onPanic)
		}
	}()
	resp, err := o.g.runPhase(o.ctx, o.k, c, info, f)
	returned = true
	if info.settled {
		return resp, Settled, err
	}
	if err != nil {
		return resp, info.disposition(), err
	}
	resp, d := info.outcome(resp)
	return resp, d, nil
}

// runPhase runs f for claim c of k on ctx with info in it, under
// Options.OperationTimeout, as the call's PhaseRun; a panic is reported as
// the phase's end and goes on. The one way an operation is run, whether
// under a lease or in a store's transaction.
func (g *Guard) runPhase(ctx context.Context, k Key, c Claim, info *Info, f func(ctx context.Context) (Response, error)) (Response, error) {
	fctx := context.WithValue(ctx, infoKey{}, info)
	if d := g.opts.OperationTimeout; d > 0 {
		var cancel context.CancelFunc
		fctx, cancel = context.WithTimeout(fctx, d)
		defer cancel()
	}
	fctx, endRun := g.startPhase(fctx, PhaseRun, PhaseStart{Scope: k.Scope, Attempt: c.Attempt, Token: c.Token})
	returned := false
	defer func() {
		if !returned {
			endRun(errPanicked)
		}
	}()
	resp, err := f(fctx)
	endRun(err)
	returned = true
	return resp, err
}

// settle ends the lease and applies d to the record, unless the lease was
// lost first: then it changes nothing and returns why, except for Settled,
// where the operation stored its outcome itself. A renewal in flight is
// waited for first (see awaitRenewal). The store call has until the lease's
// local end; should it not answer by then, settle returns ErrUnavailable
// without waiting for it: the outcome may or may not be stored, and a retry
// finds out which.
func (o *owner) settle(resp Response, d Disposition) error {
	d = o.keepHistory(d)
	// A renewal that lands after the record was given up would take it back.
	o.awaitRenewal(d == abandon)
	deadline, lost := o.end()
	if d == Settled {
		o.cs.disposition = d
		return nil
	}
	if lost != nil {
		return lost
	}
	ctx, cancel := context.WithDeadline(o.calls, deadline)
	defer cancel()
	ctx, endSettle := o.g.startPhase(ctx, PhaseSettle, PhaseStart{Scope: o.k.Scope, Attempt: o.c.Attempt, Token: o.c.Token})
	err := o.g.applyWithin(ctx, o.k, o.c.Token, resp, d)
	endSettle(err)
	switch {
	case err != nil:
		o.cs.op = settleOp(d)
		o.cancel(err)
		return err
	}
	o.cs.disposition = d
	if d != Keep {
		// The record is free for another owner while an operation that
		// settled early may still run: its context ends now.
		o.cancel(fmt.Errorf("%w: the record was given up (%v)", ErrFenced, d))
	}
	return nil
}

// keepHistory turns a Forget into a Release once the operation may have had
// an effect: an earlier attempt ran (this one is a takeover), or this one
// began a step. Forgetting would erase the operation ID, the attempt count
// and the recovery points, so the next attempt would repeat the steps under
// a new DownstreamKey. A release keeps all three. This is the one place the
// rule is enforced: every settle, whoever chose the disposition, passes here.
func (o *owner) keepHistory(d Disposition) Disposition {
	if d == Forget && (o.c.Attempt > 1 || o.pts.began.Load()) {
		return Release
	}
	return d
}

// settleOp names the store call that applies d, for an Observer.
func settleOp(d Disposition) string {
	switch d {
	case Release:
		return OpRelease
	case Forget:
		return OpForget
	case abandon:
		return OpAbandon
	}
	return OpComplete
}

// awaitRenewal sends no more renewals and waits for the one in flight, if
// any, so that the outcome goes out on the renewal's connection rather than
// a new one, which a slow network makes cost several round trips (and a
// confirmed renewal leaves the outcome more time). It waits as long as a
// sound connection would take, twice the last confirmed round trip plus the
// margin, and never past the lease's local end: a renewal slower than that
// is taken for one stuck on its connection. With full, it waits until that
// end.
func (o *owner) awaitRenewal(full bool) {
	o.mu.Lock()
	o.settling = true
	renewing := o.renewing
	left := time.Until(o.deadline)
	if !full {
		left = min(left, time.Until(o.renewed.Add(2*o.rtt+leaseMargin(o.g.opts.Lease))))
	}
	o.mu.Unlock()
	if renewing == nil || left <= 0 {
		return
	}
	t := time.NewTimer(left)
	defer t.Stop()
	select {
	case <-renewing:
	case <-t.C:
	}
}

// applyWithin is apply, returning by ctx's deadline whether or not the
// store has answered (see within).
func (g *Guard) applyWithin(ctx context.Context, k Key, token uint64, resp Response, d Disposition) error {
	err := g.within(ctx, func(ctx context.Context) error {
		return apply(ctx, g.store, k, token, resp, d, g.opts.Retention)
	})
	if err != nil && ctx.Err() != nil && !errors.Is(err, ErrFenced) {
		return fmt.Errorf("%w: the store did not confirm the outcome before the lease ran out: %w", ErrUnavailable, err)
	}
	return err
}

// within makes the store call call, returning by ctx's deadline whether or
// not the store has answered. A store of this package whose calls end by
// their context's deadline (see New) is called on the caller's goroutine;
// any other on a goroutine of its own, which the caller stops waiting for
// at the deadline. The first spares each operation a goroutine and the
// hand-over of its result, which an idle machine pays in wake-ups.
func (g *Guard) within(ctx context.Context, call func(ctx context.Context) error) error {
	if g.callsEndByDeadline {
		return call(ctx)
	}
	done := make(chan error, 1)
	go func() { done <- call(ctx) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// write makes a store call for the owner while it holds the lease, until
// the lease's local end, wherever the renewals confirmed during the call
// move it: the owner's timer ends o.ctx there, and that ends the call. Its
// deadline, a lease past the end known when it starts, only backstops a
// store that ends a call by its deadline alone. A deadline fixed at the
// start would cut off a step's save that waits for a connection while
// renewals keep the lease: the step would run unrecorded, and again on
// the retry.
// A call the store fences loses the lease: the operation's context is
// done. A call cut off by its context fails with why the lease was lost,
// if it was, and ErrUnavailable otherwise, as any store failure.
func (o *owner) write(ctx context.Context, call func(ctx context.Context) error) error {
	o.mu.Lock()
	err, deadline := o.usableLocked(), o.deadline
	o.mu.Unlock()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithDeadline(ctx, deadline.Add(o.g.opts.Lease))
	defer cancel()
	defer context.AfterFunc(o.ctx, cancel)()
	err = o.g.within(ctx, call)
	o.mu.Lock()
	defer o.mu.Unlock()
	switch {
	case errors.Is(err, ErrFenced):
		o.loseLocked(err)
	case err == nil || errors.Is(err, ErrUnavailable):
	case o.lost != nil:
		err = o.lost
	default:
		err = fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	return err
}

// usable fails when the owner may write no more: its lease was lost, or
// its record settled.
func (o *owner) usable() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.usableLocked()
}

func (o *owner) usableLocked() error {
	switch {
	case o.lost != nil:
		return o.lost
	case o.ended:
		return fmt.Errorf("%w: the operation's record was settled", ErrFenced)
	}
	return nil
}

// apply is the store call that gives d effect on s for the owner of token;
// a completion keeps resp for retention.
func apply(ctx context.Context, s Store, k Key, token uint64, resp Response, d Disposition, retention time.Duration) error {
	switch d {
	case Keep:
		return s.Complete(ctx, k, token, resp, retention)
	case Release:
		return s.Release(ctx, k, token)
	case Forget:
		return s.Forget(ctx, k, token)
	case abandon:
		return s.Abandon(ctx, k, token)
	}
	return fmt.Errorf("idempotency: no store call settles %v", d)
}

// end ends the lease for settling: from now on renewals neither extend nor
// lose it. It returns the lease's local end, and why it was lost, if it
// was, counting a deadline that passed while the timer had yet to fire.
func (o *owner) end() (deadline time.Time, lost error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.lost == nil && !time.Now().Before(o.deadline) {
		o.loseLocked(o.expired())
	}
	o.settling, o.ended = true, true
	o.timer.Stop()
	return o.deadline, o.lost
}

// tick runs from the timer: it ends the lease once its deadline has come,
// and otherwise sends the renewal that is due. One renewal is in flight at
// a time, so that renewals reuse one connection; one that is due while
// another is in flight goes out when that one returns.
func (o *owner) tick() {
	now := time.Now()
	o.mu.Lock()
	if o.ended {
		o.mu.Unlock()
		return
	}
	if !now.Before(o.deadline) {
		o.loseLocked(o.expired())
		o.mu.Unlock()
		return
	}
	renew := !o.settling && o.renewing == nil && !now.Before(o.next)
	if renew {
		o.next, o.renewed = now.Add(o.g.opts.Lease/3), now
		o.renewing = make(chan struct{})
	}
	o.armLocked(now)
	deadline := o.deadline
	o.mu.Unlock()
	if renew {
		o.renew(now, deadline)
	}
}

// armLocked sets the timer for what comes first: the lease's end, or the
// next renewal when one may be sent. o.mu is held.
func (o *owner) armLocked(now time.Time) {
	at := o.deadline
	if !o.settling && o.renewing == nil && o.next.Before(at) {
		at = o.next
	}
	o.timer.Reset(at.Sub(now))
}

// renew sends one renewal, sent at sent, with the lease's current local end
// as its deadline. A confirmed renewal moves the end to sent + Lease -
// margin, however late its reply came; a refused one loses the lease; any
// other failure changes nothing, since the lease may still be live: the
// next renewal may get through.
func (o *owner) renew(sent, deadline time.Time) {
	lease := o.g.opts.Lease
	ctx, cancel := context.WithDeadline(o.calls, deadline)
	defer cancel()
	err := o.g.store.Heartbeat(ctx, o.k, o.c.Token, lease)
	if o.g.opts.Observer != nil {
		e := Event{Kind: EventRenewal, Scope: o.k.Scope, Attempt: o.c.Attempt, Duration: time.Since(sent), Err: err}
		if err != nil {
			e.Op = OpRenew
		}
		o.g.opts.Observer.Observe(o.ctx, e)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	close(o.renewing)
	o.renewing = nil
	switch {
	case o.ended:
		return
	case err == nil:
		if d := sent.Add(lease - leaseMargin(lease)); d.After(o.deadline) {
			o.deadline = d
		}
		o.rtt = time.Since(sent)
	case errors.Is(err, ErrFenced):
		o.loseLocked(err)
		return
	default:
		o.failed = err
	}
	o.armLocked(time.Now())
}

// lostErr returns why the lease was lost, or nil.
func (o *owner) lostErr() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.lost
}

// expired is the cause of a lease that ran out locally. o.mu is held.
func (o *owner) expired() error {
	err := fmt.Errorf("%w: lease ran out: no renewal confirmed in time (lease %v, margin %v)",
		ErrFenced, o.g.opts.Lease, leaseMargin(o.g.opts.Lease))
	if o.failed != nil {
		return fmt.Errorf("%w: last renewal: %w", err, o.failed)
	}
	return err
}

// loseLocked ends the lease with cause: the operation's context is
// cancelled with it, and nothing more is renewed or settled. o.mu is held.
func (o *owner) loseLocked(cause error) {
	if o.lost == nil {
		o.lost = cause
	}
	o.settling, o.ended = true, true
	o.timer.Stop()
	o.cancel(o.lost)
}
