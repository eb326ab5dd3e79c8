package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/postgres"
	"github.com/stretchr/testify/assert"
)

// pointsLedger is what the owners of a few keys were told: each step whose
// save the store confirmed, and when; and how many takeovers found points.
type pointsLedger struct {
	mu        sync.Mutex
	confirmed map[string]map[string]time.Time // key → step → confirmation
	takeovers atomic.Int64                    // claims of attempt 2 or later
	found     atomic.Int64                    // points those claims read back
}

func (l *pointsLedger) confirm(k, step string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.confirmed[k] == nil {
		l.confirmed[k] = map[string]time.Time{}
	}
	l.confirmed[k][step] = time.Now()
}

// missing returns the steps of k confirmed before sent that points lacks.
func (l *pointsLedger) missing(k string, sent time.Time, points []idempotency.RecoveryPoint) []string {
	have := map[string]bool{}
	for _, p := range points {
		have[p.Step] = true
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for step, at := range l.confirmed[k] {
		if at.Before(sent) && !have[step] {
			out = append(out, step)
		}
	}
	return out
}

// testPointsSurviveTakeovers races owners of a few keys under a lease of
// 600ms, each saving points, renewing, then releasing, abandoning, stalling
// past its lease and saving once more, or just stopping, while the others
// take the records over: every owner reads back every point whose save was
// confirmed before its claim was sent.
func testPointsSurviveTakeovers(t *testing.T, f *fixture) {
	s, _ := f.store(t)
	l := &pointsLedger{confirmed: map[string]map[string]time.Time{}}
	stop := time.Now().Add(4 * time.Second)
	var wg sync.WaitGroup
	for w := range 12 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(w), 7))
			for n := 0; time.Now().Before(stop); n++ {
				k := fmt.Sprintf("chaos-%d", r.IntN(6))
				if err := ownOnce(t.Context(), s, l, r, k, fmt.Sprintf("w%d-%d", w, n)); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	assert.NotZero(t, l.takeovers.Load(), "no record was taken over")
	assert.NotZero(t, l.found.Load(), "no takeover found points")
}

// ownOnce claims k and, as its owner, checks the points it reads back,
// then acts as one owner would, naming its steps after id.
func ownOnce(ctx context.Context, s *postgres.Store, l *pointsLedger, r *rand.Rand, k, id string) error {
	req := request(k, 600*time.Millisecond)
	sent := time.Now()
	c, err := s.Claim(ctx, req)
	if err != nil || c.State != idempotency.Owner {
		time.Sleep(time.Duration(r.IntN(50)) * time.Millisecond)
		return nil
	}
	ps, err := s.RecoveryPoints(ctx, req.Key, c.Token)
	switch {
	case err != nil && !errors.Is(err, idempotency.ErrFenced):
		return err
	case err == nil && c.Attempt > 1:
		l.takeovers.Add(1)
		l.found.Add(int64(len(ps)))
	}
	if lost := l.missing(k, sent, ps); err == nil && len(lost) > 0 {
		return fmt.Errorf("%s, attempt %d: confirmed points %v are gone (%d read)", k, c.Attempt, lost, len(ps))
	}
	for i := range 1 + r.IntN(3) {
		savePoint(ctx, s, l, req.Key, c.Token, fmt.Sprintf("%s-%d", id, i))
		if r.IntN(2) == 0 {
			_ = s.Heartbeat(ctx, req.Key, c.Token, req.Lease)
		}
	}
	switch r.IntN(4) {
	case 0:
		_ = s.Release(ctx, req.Key, c.Token)
	case 1:
		_ = s.Abandon(ctx, req.Key, c.Token)
	case 2:
		time.Sleep(req.Lease + time.Duration(r.IntN(100))*time.Millisecond) // stalled past its lease
		savePoint(ctx, s, l, req.Key, c.Token, id+"-late")
		_ = s.Release(ctx, req.Key, c.Token)
	}
	return nil
}

// savePoint saves step for token, and notes it in l if the store confirmed it.
func savePoint(ctx context.Context, s *postgres.Store, l *pointsLedger, k idempotency.Key, token uint64, step string) {
	if s.SaveRecoveryPoint(ctx, k, token, idempotency.RecoveryPoint{Step: step, Result: []byte("1")}) == nil {
		l.confirm(k.Name, step)
	}
}
