package faultsuite

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
)

// The checks themselves, on memory stores broken on purpose and no faults:
// each breakage must be counted, or the zeros of the fault runs would
// prove nothing. Nothing is reported: these are not the library's counts.
func TestChecksCatchBrokenStores(t *testing.T) {
	quiet := scenario{name: "quiet", loadFor: 1500 * time.Millisecond, faults: func(ctx context.Context, _ *network) { <-ctx.Done() }}
	for _, c := range []struct {
		name   string
		store  idempotency.Store
		caught func(*tally) int
	}{
		{"leases judged by a clock eight times too fast", idempotency.NewMemoryStore(idempotency.MemoryOptions{Now: fastClock(8)}),
			func(tl *tally) int { return tl.doubles }},
		{"completions released instead of kept", losing{idempotency.NewMemoryStore(idempotency.MemoryOptions{})},
			func(tl *tally) int { return tl.lost }},
		{"waiters never shown the outcome", deaf{idempotency.NewMemoryStore(idempotency.MemoryOptions{})},
			func(tl *tally) int { return tl.stranded }},
		{"replays of the last completed response, whatever the key", &crossed{MemoryStore: idempotency.NewMemoryStore(idempotency.MemoryOptions{})},
			func(tl *tally) int { return tl.wrong }},
		{"recovery points confirmed but not kept", unkept{newSecondAttempt()},
			func(tl *tally) int { return tl.stepReruns }},
		{"recovery points read back with another step's result", misread{newSecondAttempt()},
			func(tl *tally) int { return tl.wrong }},
	} {
		t.Run(c.name, func(t *testing.T) {
			tg := newTarget(t, "memory", nil, func(*testing.T, dialFunc) idempotency.Store { return c.store })
			tl := tg.load(t, quiet).count()
			if c.caught(tl) == 0 {
				t.Errorf("not counted: %s", tl.notes())
			}
			t.Logf("counted %d; %s", c.caught(tl), tl.notes())
		})
	}
}

// fastClock is a clock that runs rate times as fast as the real one.
func fastClock(rate time.Duration) func() time.Time {
	start := time.Now()
	return func() time.Time { return start.Add(time.Since(start) * rate) }
}

// losing is a store that releases the records it is asked to complete, and
// says it completed them.
type losing struct{ *idempotency.MemoryStore }

func (s losing) Complete(ctx context.Context, k idempotency.Key, token uint64, _ idempotency.Response, _ time.Duration) error {
	return s.Release(ctx, k, token)
}

// deaf is a store that answers a waiter's claim of a completed record as
// if the record were still in flight.
type deaf struct{ *idempotency.MemoryStore }

func (s deaf) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	c, err := s.MemoryStore.Claim(ctx, req)
	if err == nil && req.Watch && c.State == idempotency.Completed {
		return idempotency.Claim{State: idempotency.InFlight, LeaseLeft: lease}, nil
	}
	return c, err
}

// crossed is a store that replays the response it completed last, for
// every key.
type crossed struct {
	*idempotency.MemoryStore
	mu   sync.Mutex
	last idempotency.Response
}

func (s *crossed) Complete(ctx context.Context, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	s.mu.Lock()
	s.last = resp
	s.mu.Unlock()
	return s.MemoryStore.Complete(ctx, k, token, resp, retention)
}

func (s *crossed) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	c, err := s.MemoryStore.Claim(ctx, req)
	if err == nil && c.State == idempotency.Completed {
		s.mu.Lock()
		c.Response = s.last
		s.mu.Unlock()
	}
	return c, err
}

// secondAttempt is a memory store that fails the first completion of each
// operation made of steps, and releases its record as a failed operation
// would: every such operation runs a second attempt, which reads the
// recovery points of the first.
type secondAttempt struct {
	*idempotency.MemoryStore
	mu     sync.Mutex
	failed map[idempotency.Key]bool
}

func newSecondAttempt() *secondAttempt {
	return &secondAttempt{MemoryStore: idempotency.NewMemoryStore(idempotency.MemoryOptions{}), failed: make(map[idempotency.Key]bool)}
}

func (s *secondAttempt) Complete(ctx context.Context, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	s.mu.Lock()
	first := stepwise(k.Name) && !s.failed[k]
	s.failed[k] = true
	s.mu.Unlock()
	if first {
		return errors.Join(fmt.Errorf("%w: the first completion fails", idempotency.ErrUnavailable), s.Release(ctx, k, token))
	}
	return s.MemoryStore.Complete(ctx, k, token, resp, retention)
}

// unkept confirms the recovery points it is given, and keeps none.
type unkept struct{ *secondAttempt }

func (unkept) SaveRecoveryPoint(context.Context, idempotency.Key, uint64, idempotency.RecoveryPoint) error {
	return nil
}

// misread reads each recovery point back with the result of the one saved
// before it.
type misread struct{ *secondAttempt }

func (s misread) RecoveryPoints(ctx context.Context, k idempotency.Key, token uint64) ([]idempotency.RecoveryPoint, error) {
	ps, err := s.secondAttempt.RecoveryPoints(ctx, k, token)
	for i := len(ps) - 1; i > 0; i-- {
		ps[i].Result = ps[i-1].Result
	}
	return ps, err
}
