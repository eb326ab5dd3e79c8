package idempotency

import (
	"context"
	"errors"
	"time"
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
	start := time.Now()
	list, err := g.store.ListAbandoned(ctx, limit)
	if err != nil {
		g.observe(ctx, Event{Kind: EventSweep, Duration: time.Since(start), Op: OpAbandoned, Err: err})
		return 0, err
	}
	settled := 0
	var errs []error
	for _, a := range list {
		sent := time.Now()
		c, err := g.store.Claim(ctx, ClaimRequest{Key: a.Key, Fingerprint: a.Fingerprint, OperationID: newOperationID(),
			Lease: g.opts.Lease, Retention: g.opts.Retention})
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if c.State != Owner {
			continue // settled, or taken over by a retry, since it was listed
		}
		ok, err := g.sweepOne(ctx, a.Key, c, sent)
		if err != nil && !errors.Is(err, ErrUnknown) {
			errs = append(errs, err)
		}
		if ok {
			settled++
		}
	}
	err = errors.Join(errs...)
	g.observe(ctx, Event{Kind: EventSweep, Duration: time.Since(start), Found: len(list), Settled: settled,
		Left: len(list) - settled, Err: err})
	return settled, err
}

// sweepOne settles, through Options.Recover, one listed record that the
// sweeper now owns through c, sent at sent, under the lease an owner keeps.
// It reports whether the hook settled it.
func (g *Guard) sweepOne(ctx context.Context, k Key, c Claim, sent time.Time) (bool, error) {
	o, err := g.own(ctx, k, c, sent)
	if err != nil {
		return false, err
	}
	defer o.close()
	if !c.Abandoned {
		// Released, or expired and so made anew by this very claim:
		// nothing to recover. Give it back as it was.
		return false, o.settle(Response{}, untouched(c))
	}
	_, d, err := o.recover()
	if err != nil {
		return false, err
	}
	if d == Release || d == Forget {
		// The operation never happened: free the key for its client.
		if err := o.settle(Response{}, d); err != nil {
			return false, err
		}
	}
	return true, nil
}
