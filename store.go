package idempotency

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
)

// This file holds what a store implements, and nothing a Guard's user needs.

// Store keeps records. Each method is one atomic transition of the record's
// state machine, judged by the store's own clock; implementations must pass
// the conformance suite in package idempotencytest. Errors other than
// ErrFenced must wrap ErrUnavailable.
//
// A store whose client resends a call whose reply was lost (go-redis does)
// answers for the resend. A Claim resent recognises the record it made or
// took over, while nobody took it over since; a Complete resent finds its
// own response stored and succeeds. Otherwise the resend answers as a
// call made then would: a Claim whose lease ran out and was taken over
// meanwhile gets InFlight (its record is taken over as abandoned, though
// nothing ran under it), and a Release, Forget, Heartbeat or Abandon
// ErrFenced, the caller owning nothing now, though its change was made.
type Store interface {
	// Claim applies a claim to the record of req.Key:
	//   - no record: create it in flight, attempt 1, a new token, and
	//     req.OperationID; State Owner.
	//   - a different fingerprint, whatever the state: State Mismatch.
	//   - completed: State Completed with the stored Response.
	//   - in flight under a live lease: State InFlight; with req.Watch, the
	//     record remembers that someone waits, so that settling it wakes
	//     them (see Subscribe).
	//   - in flight under an expired lease, or released: take over: attempt
	//     + 1, a new token, the same operation ID, and a retention of at
	//     least req.Retention from now; State Owner, and Abandoned when the
	//     lease had expired.
	// A new token is greater than every token issued before for the key,
	// even if the record expired and was made again in between.
	Claim(ctx context.Context, req ClaimRequest) (Claim, error)
	// Complete stores resp as the record's outcome and keeps it for
	// retention, if token is the current owner's; otherwise it returns
	// ErrFenced and changes nothing. resp's header and body are the
	// caller's once Complete returns: a store that keeps them in memory
	// keeps a copy.
	Complete(ctx context.Context, k Key, token uint64, resp Response, retention time.Duration) error
	// Release ends the current owner's attempt without an outcome, if token
	// is the current owner's (ErrFenced otherwise): the next claim takes
	// over, with the same operation ID.
	Release(ctx context.Context, k Key, token uint64) error
	// Forget deletes the record, if token is the current owner's (ErrFenced
	// otherwise), so that the key is free for any request.
	Forget(ctx context.Context, k Key, token uint64) error
	// Heartbeat extends the current owner's lease to lease (above 0) from
	// now, if token is the current owner's (ErrFenced otherwise). It moves
	// the record's expiry as far as it moves the lease, and never to before
	// the lease's end: an owner that runs past the retention keeps its
	// record (expired, a claim would make a new one and a second owner), and
	// if it then dies the record is abandoned as any other, for as long
	// after its lease as a record never renewed.
	Heartbeat(ctx context.Context, k Key, token uint64, lease time.Duration) error
	// Abandon gives the current owner's lease up without settling the
	// record, if token is the current owner's (ErrFenced otherwise): it
	// stays in flight, listed by ListAbandoned, and the next claim takes it
	// over with Claim.Abandoned set.
	Abandon(ctx context.Context, k Key, token uint64) error
	// ListAbandoned lists up to limit records that are in flight with a lease
	// that ran out, the longest expired first, so that records no one can
	// settle yet do not hide the others; limit <= 0 lists none. Its cost
	// grows with the records in flight, not with all the records kept.
	ListAbandoned(ctx context.Context, limit int) ([]AbandonedRecord, error)
	// Subscribe returns once the caller is certain to be woken by every
	// Complete or Release of k's record that follows a watching Claim. It
	// may wake spuriously; the caller re-claims on every wake-up.
	Subscribe(ctx context.Context, k Key) (Subscription, error)
}

// RecoveryPointStore is implemented by a Store that keeps the recovery
// points of Step with the record, through every transition but two: a
// completion and a forgetting drop them, and a record made anew (the first
// claim of a key, or one after the record expired) has none. Every store in
// this module and the postgres package is one.
type RecoveryPointStore interface {
	// SaveRecoveryPoint adds p to the record's recovery points, after those
	// saved before, if token is the current owner's (ErrFenced otherwise);
	// it is durable once the call returns. A point of a step saved before
	// adds nothing, so a resend whose reply was lost is harmless.
	SaveRecoveryPoint(ctx context.Context, k Key, token uint64, p RecoveryPoint) error
	// RecoveryPoints returns the record's recovery points in the order they
	// were saved, one per step, if token is the current owner's (ErrFenced
	// otherwise).
	RecoveryPoints(ctx context.Context, k Key, token uint64) ([]RecoveryPoint, error)
}

// DeadlineBound is implemented by a Store whose every call returns by its
// context's deadline, however silent its connection. A Guard made with such
// a store settles records on the caller's goroutine, which spares each
// operation a goroutine and its hand-over; with any other store it settles
// them on a goroutine of its own, which it stops waiting for at the lease's
// local end. EndsByDeadline is given the Store the Guard was made with, and
// vouches only if that is the implementing value itself: a type that embeds
// a Store, and may replace the very calls it vouches for, inherits the
// method but not the vouch.
type DeadlineBound interface {
	EndsByDeadline(s Store) bool
}

// Transactor is implemented by a store that runs an operation in one
// transaction of its own with its claim and its outcome (the postgres
// package's OneCommit); a Guard made with one runs every operation so.
// Nobody sees the record in flight; an operation that fails, returns keep
// false, panics, or whose process dies leaves nothing behind.
//
// Transact claims req.Key in the transaction. A duplicate in flight is
// waited for on the store's own lock for at most wait (negative: not at
// all), then Transact fails with an error that matches ErrInFlight. A
// completed record answers State Completed with its Response, one of
// another fingerprint State Mismatch, both without running op. Otherwise
// op runs, for attempt 1 with the claim's token and operation ID, on a
// context that carries the transaction; when it returns keep and no error,
// its response is stored and the transaction commits, and Transact answers
// State Owner. op's error is returned as it is; the store's own errors wrap
// ErrUnavailable.
type Transactor interface {
	Transact(ctx context.Context, req ClaimRequest, wait time.Duration,
		op func(ctx context.Context, c Claim) (resp Response, keep bool, err error)) (Claim, error)
}

// Subscription delivers wake-ups for one record until it is closed.
type Subscription interface {
	// C receives a value after the record may have changed.
	C() <-chan struct{}
	// Close ends the subscription. It must be called.
	Close()
}

// ClaimRequest is the input of Store.Claim.
type ClaimRequest struct {
	Key         Key
	Fingerprint Fingerprint
	OperationID string        // 1..255 bytes, unique to this claim; kept only when the claim creates the record
	Lease       time.Duration // how long the new owner holds the record
	Retention   time.Duration // how long a new record is kept, and at least how long a taken-over one is
	Watch       bool          // the caller will wait if the record is in flight
}

// AbandonedRecord is a record in flight whose owner's lease ran out: what
// a sweeper needs to claim it.
type AbandonedRecord struct {
	Key         Key
	Fingerprint Fingerprint
}

// ClaimState is the answer to a claim.
type ClaimState int

const (
	// Owner: the caller owns the record and must run the operation.
	Owner ClaimState = iota + 1
	// Completed: the record holds an outcome to replay.
	Completed
	// InFlight: another owner holds a live lease.
	InFlight
	// Mismatch: the record belongs to a different request.
	Mismatch
)

// Claim is the output of Store.Claim.
type Claim struct {
	State       ClaimState
	OperationID string        // Owner, Completed
	Attempt     int           // Owner: this attempt's number, from 1
	Token       uint64        // Owner: this attempt's fencing token
	Abandoned   bool          // Owner: the previous attempt's lease ran out unsettled
	Response    Response      // Completed
	LeaseLeft   time.Duration // InFlight: time until the owner's lease runs out; a waiter re-claims then
}

// Stats counts a store's records in flight, for dashboards and alerts: a
// count of Abandoned that grows and stays up means abandoned operations
// that no retry and no sweep settles. The stores in this module and the
// postgres package have a Stats method; it costs about as much as one call
// of ListAbandoned, so read it on a scrape interval, not per request.
type Stats struct {
	// InFlight counts the records in flight whose owner's lease is live.
	InFlight int64
	// Abandoned counts the records in flight whose lease ran out and that
	// no claim took over yet: they wait for a retry or a sweep.
	Abandoned int64
}

// CompleteOutside is for a store that completes a record inside the
// caller's own transaction, as the postgres package's Store.CompleteTx
// does; an application calls that method, not this function. It has
// complete store resp as the outcome of the operation in ctx, for the
// record's key, under the attempt's fencing token, with the Guard's
// retention, and fails without calling it when ctx carries no operation
// (ErrNoOperation), when the operation's Guard keeps its records in a store
// other than s (ErrForeignStore), when the lease has ended (ErrFenced), or
// when the operation was already completed.
//
// Once complete succeeds, resp is the operation's outcome if the operation
// then succeeds (it returns no error, and the disposition it ends with is
// Keep, as for a handler that writes nothing): Do returns resp, the
// middleware answers with it, and the Guard stores nothing more. An
// operation that fails instead is given up as usual (its record released),
// which the store refuses if the transaction committed: the caller gets
// ErrFenced (a 503), and its retry replays what was committed.
func CompleteOutside(ctx context.Context, s Store, resp Response, complete func(k Key, token uint64, retention time.Duration) error) error {
	i, ok := FromContext(ctx)
	if !ok {
		return fmt.Errorf("%w to complete", ErrNoOperation)
	}
	o := i.owner
	if o == nil {
		return fmt.Errorf("%w: CompleteOutside", errOneCommit)
	}
	if s != o.g.store {
		return ErrForeignStore
	}
	i.mu.Lock()
	busy := i.completed != nil || i.finishing
	i.finishing = !busy
	i.mu.Unlock()
	if busy {
		return errors.New("idempotency: the operation was already completed")
	}
	var err error
	if err = o.lostErr(); err == nil {
		err = complete(o.k, o.c.Token, o.g.opts.Retention)
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	i.finishing = false
	if err == nil {
		i.completed = &resp
	}
	return err
}

// dueRecord is an abandoned record with the time its lease ran out, in a
// unit of the store's choosing.
type dueRecord struct {
	AbandonedRecord
	leaseEnd int64
}

// oldestFirst returns up to limit records of due, the longest abandoned
// first, as Store.ListAbandoned lists them.
func oldestFirst(due []dueRecord, limit int) []AbandonedRecord {
	slices.SortFunc(due, func(a, b dueRecord) int { return cmp.Compare(a.leaseEnd, b.leaseEnd) })
	out := make([]AbandonedRecord, 0, min(max(limit, 0), len(due)))
	for _, d := range due[:cap(out)] {
		out = append(out, d.AbandonedRecord)
	}
	return out
}
