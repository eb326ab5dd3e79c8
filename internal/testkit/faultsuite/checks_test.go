package faultsuite

import (
	"context"
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
		{"replays of the last completed response, whatever the key", &crossed{Store: idempotency.NewMemoryStore(idempotency.MemoryOptions{})},
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
type losing struct{ idempotency.Store }

func (s losing) Complete(ctx context.Context, k idempotency.Key, token uint64, _ idempotency.Response, _ time.Duration) error {
	return s.Release(ctx, k, token)
}

// deaf is a store that answers a waiter's claim of a completed record as
// if the record were still in flight.
type deaf struct{ idempotency.Store }

func (s deaf) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	c, err := s.Store.Claim(ctx, req)
	if err == nil && req.Watch && c.State == idempotency.Completed {
		return idempotency.Claim{State: idempotency.InFlight, LeaseLeft: lease}, nil
	}
	return c, err
}

// crossed is a store that replays the response it completed last, for
// every key.
type crossed struct {
	idempotency.Store
	mu   sync.Mutex
	last idempotency.Response
}

func (s *crossed) Complete(ctx context.Context, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	s.mu.Lock()
	s.last = resp
	s.mu.Unlock()
	return s.Store.Complete(ctx, k, token, resp, retention)
}

func (s *crossed) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	c, err := s.Store.Claim(ctx, req)
	if err == nil && c.State == idempotency.Completed {
		s.mu.Lock()
		c.Response = s.last
		s.mu.Unlock()
	}
	return c, err
}
