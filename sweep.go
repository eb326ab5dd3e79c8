package idempotency

import (
	"context"
	"errors"
)

// errNoRecover is returned by Sweep when there is no hook to settle with.
var errNoRecover = errors.New("idempotency: Sweep needs Options.Recover")

// Sweep settles, through Options.Recover, up to limit abandoned records
// (limit <= 0 means 100): operations whose owner crashed or stalled past its
// lease, so that they are settled even if their client never retries. Run it
// on a schedule (every few leases); several processes may sweep at once, and
// each record is recovered by one of them. A record the hook cannot settle
// yet (ErrUnknown) stays abandoned for the next sweep. Sweep returns how many
// records it settled, and the errors other than ErrUnknown it met.
func (g *Guard) Sweep(ctx context.Context, limit int) (int, error) {
	if g.opts.Recover == nil {
		return 0, errNoRecover
	}
	if limit <= 0 {
		limit = 100
	}
	list, err := g.store.Abandoned(ctx, limit)
	if err != nil {
		return 0, err
	}
	settled := 0
	var errs []error
	for _, a := range list {
		c, err := g.store.Claim(ctx, ClaimRequest{Key: a.Key, Fingerprint: a.Fingerprint, OperationID: newOperationID(),
			Lease: g.opts.Lease, Retention: g.opts.Retention})
		switch {
		case err != nil:
			errs = append(errs, err)
			continue
		case c.State != Owner:
			continue // settled, or taken over by a retry, since it was listed
		case !c.Abandoned:
			// Released, or expired and so made anew by this very claim:
			// nothing to recover. Give it back as it was.
			if err := g.store.Release(ctx, a.Key, c.Token, c.Attempt == 1); err != nil {
				errs = append(errs, err)
			}
			continue
		}
		_, d, err := g.recover(ctx, a.Key, c)
		if err != nil {
			if !errors.Is(err, ErrUnknown) {
				errs = append(errs, err)
			}
			continue
		}
		if d == Release || d == Forget {
			// The operation never happened: free the key for its client.
			if err := g.settle(ctx, a.Key, c.Token, Response{}, d); err != nil {
				errs = append(errs, err)
				continue
			}
		}
		settled++
	}
	return settled, errors.Join(errs...)
}
