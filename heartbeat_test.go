package idempotency

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An operation that runs for several leases keeps its record: every other
// claim meanwhile finds it in flight. Renewals stop when Do returns.
func TestHeartbeatKeepsTheRecord(t *testing.T) {
	const lease = 300 * time.Millisecond
	mem := NewMemoryStore(MemoryOptions{})
	var beats atomic.Int32
	s := &faultStore{Store: mem, hook: func(op string) error {
		if op == "heartbeat" {
			beats.Add(1)
		}
		return nil
	}}
	g := New(s, Options{Lease: lease})
	k, fp := Key{Name: "long"}, FingerprintOf("op", nil)
	ctx := context.Background()

	started, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := g.Do(ctx, k, fp, func(ctx context.Context) (Response, error) {
			close(started)
			select {
			case <-release:
				return Response{Status: 201}, nil
			case <-ctx.Done():
				return Response{}, context.Cause(ctx)
			}
		})
		done <- err
	}()
	<-started
	// Four leases: without renewals the record would be taken over.
	for end := time.Now().Add(4 * lease); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		c, err := mem.Claim(ctx, ClaimRequest{Key: k, Fingerprint: fp, OperationID: "other", Lease: lease, Retention: time.Hour})
		require.NoError(t, err)
		require.Equal(t, InFlight, c.State, "a claim while the owner renews its lease")
	}
	close(release)
	require.NoError(t, <-done)
	after := beats.Load()
	assert.GreaterOrEqual(t, after, int32(4), "renewals over four leases")

	time.Sleep(lease) // three renewal periods
	assert.Equal(t, after, beats.Load(), "renewals after Do returned")
}

// When every renewal fails, the owner gives up once the lease must have run
// out, no earlier: fn's context is cancelled with ErrFenced and nothing is
// stored.
func TestHeartbeatGivesUpWhenRenewalsFail(t *testing.T) {
	const lease = 150 * time.Millisecond
	var completes atomic.Int32
	s := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(op string) error {
		switch op {
		case "heartbeat":
			return unavailable("heartbeat", errInjected)
		case "complete":
			completes.Add(1)
		}
		return nil
	}}
	g := New(s, Options{Lease: lease})
	start := time.Now()
	var cause error
	_, err := g.Do(context.Background(), Key{Name: "k"}, FingerprintOf("op", nil), func(ctx context.Context) (Response, error) {
		select {
		case <-ctx.Done():
			cause = context.Cause(ctx)
		case <-time.After(10 * time.Second):
		}
		return Response{Status: 201}, nil
	})
	assert.ErrorIs(t, cause, ErrFenced)
	assert.ErrorIs(t, cause, errInjected, "the cause names the renewals' failure")
	assert.ErrorIs(t, err, ErrFenced)
	assert.GreaterOrEqual(t, time.Since(start), lease, "gave up before the lease could have run out")
	assert.Zero(t, completes.Load(), "an outcome was stored after the lease was lost")
}

// A renewal still running when fn returns decides the outcome: Do waits for
// it, and when the store refuses it, nothing is stored.
func TestHeartbeatStopWaitsForRenewal(t *testing.T) {
	entered, refuse := make(chan struct{}), make(chan struct{})
	completed := make(chan struct{}, 1)
	var once sync.Once
	var completes atomic.Int32
	s := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(op string) error {
		switch op {
		case "heartbeat":
			once.Do(func() { close(entered) })
			<-refuse
			return ErrFenced
		case "complete":
			completes.Add(1)
			completed <- struct{}{}
		}
		return nil
	}}
	g := New(s, Options{Lease: 30 * time.Millisecond})
	done := make(chan error, 1)
	go func() {
		_, err := g.Do(context.Background(), Key{Name: "k"}, FingerprintOf("op", nil), func(context.Context) (Response, error) {
			select {
			case <-entered:
			case <-time.After(10 * time.Second):
			}
			return Response{Status: 201}, nil
		})
		done <- err
	}()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		require.FailNow(t, "no renewal began")
	}
	// A Do that did not wait would complete now; give it the chance.
	select {
	case <-completed:
	case <-time.After(200 * time.Millisecond):
	}
	close(refuse)
	err := <-done
	assert.True(t, errors.Is(err, ErrFenced), "Do returned %v, want ErrFenced: it did not wait for the renewal", err)
	assert.Zero(t, completes.Load(), "an outcome was stored although the renewal was refused")
}
