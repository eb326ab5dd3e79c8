package idempotency

import (
	"context"
	"errors"
	"fmt"
)

// The one-commit mode. A store that is a Transactor (the postgres
// package's OneCommit) claims the key, runs the operation and stores its
// outcome in one transaction of its own, so there is no lease to renew, no
// record in flight to recover and nothing to settle after a failure: the
// transaction's rollback undoes the claim with the operation's own
// database effects. The Guard's part is small, which is why it lives in
// the root package: it must run fn with an Info, choose the disposition as
// for any operation (SetDisposition, the middleware's status policy) and
// tell the Observer, and only the Guard can do that. Everything the lease
// path does beyond that (renewals, fencing, recovery points, early
// settlement) has no meaning inside one transaction: an Info of this mode
// has no owner, and the functions that need one say so (see Step,
// RecoveryPoints, CompleteOutside, SaveStepOutside and settleEarly).

// errOneCommit is wrapped by the calls an operation cannot make in the
// one-commit mode, where the store completes the record in its own
// transaction.
var errOneCommit = errors.New("idempotency: not in the one-commit mode, whose store completes the record in its own transaction")

// transact runs fn through t in one transaction (see Transactor). Its
// answers map as a claim's do: Completed is a replay, Mismatch ErrMismatch
// once no other fingerprint of the request matches (see Guard.rematch),
// Owner the response fn returned, stored when fn kept it.
func (g *Guard) transact(ctx context.Context, t Transactor, k Key, fp Fingerprint, fn func(ctx context.Context) (Response, error), cs *callState) (Result, error) {
	res, err := g.transactOnce(ctx, t, k, fp, fn, cs)
	if errors.Is(err, ErrMismatch) {
		err = tryOthers(cs, func(fp Fingerprint) (err error) {
			res, err = g.transactOnce(ctx, t, k, fp, fn, cs)
			return err
		})
	}
	return res, err
}

// transactOnce is transact under the one fingerprint fp. A record it made
// for a key older than the retention is not run (see refuseExpired): the
// transaction rolls back, leaving nothing.
func (g *Guard) transactOnce(ctx context.Context, t Transactor, k Key, fp Fingerprint, fn func(ctx context.Context) (Response, error), cs *callState) (Result, error) {
	req := ClaimRequest{Key: k, Fingerprint: fp, OperationID: newOperationID(), Lease: g.opts.Lease, Retention: g.opts.Retention}
	if !g.opts.CancelWithCaller {
		// As for an owner (see Guard.own): a caller that goes away does not
		// abort the operation half-way; the lease bounds it, through the
		// store's idle-in-transaction limit.
		ctx = context.WithoutCancel(ctx)
	}
	var resp Response
	op := func(ctx context.Context, c Claim) (Response, bool, error) {
		if err := g.expiredKey(cs); err != nil {
			return Response{}, false, err
		}
		cs.owned, cs.attempt = true, c.Attempt
		var err error
		var d Disposition
		resp, d, err = g.runOneCommit(ctx, k, c, fn)
		cs.disposition = d
		return resp, err == nil && d == Keep, err
	}
	c, err := t.Transact(ctx, req, g.opts.WaitTimeout, op)
	switch {
	case err != nil:
		if !cs.owned {
			cs.op = OpClaim
		}
		return Result{}, err
	case c.State == Completed:
		return Result{Response: c.Response, Replayed: true, OperationID: c.OperationID}, nil
	case c.State == Mismatch:
		return Result{}, ErrMismatch
	case c.State != Owner:
		return Result{}, fmt.Errorf("%w: one-commit answer of state %d", ErrUnavailable, c.State)
	}
	return Result{Response: resp, OperationID: c.OperationID}, nil
}

// runOneCommit runs fn for claim c inside the store's transaction, whose
// context is ctx, with an Info of no owner, and returns its response and
// disposition. A panic goes on, and the store rolls back.
func (g *Guard) runOneCommit(ctx context.Context, k Key, c Claim, fn func(ctx context.Context) (Response, error)) (Response, Disposition, error) {
	info := &Info{OperationID: c.OperationID, Attempt: c.Attempt, Token: c.Token}
	g.owners.Add(1)
	defer g.owners.Add(-1)
	resp, err := g.runPhase(ctx, k, c, info, fn)
	if err != nil {
		return resp, Release, err
	}
	resp, d := info.outcome(resp)
	return resp, d, nil
}

// oneCommit reports that i runs in the one-commit mode: it has no owner.
func (i *Info) oneCommit() bool { return i.owner == nil }
