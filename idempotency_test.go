package idempotency

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Operation IDs carry 128 random bits, in base32 after "op_".
func TestNewOperationID(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		id := newOperationID()
		require.True(t, strings.HasPrefix(id, "op_"), id)
		raw, err := b32.DecodeString(id[3:])
		require.NoError(t, err, id)
		require.Len(t, raw, 16, id)
		require.False(t, seen[id], "%s made twice", id)
		seen[id] = true
	}
}

// DownstreamKey outside an operation fails instead of handing out "", which
// a provider would take for no key; inside, each name has a key of its own.
func TestDownstreamKeyNeedsAnOperation(t *testing.T) {
	_, err := DownstreamKey(context.Background(), "gateway")
	require.ErrorIs(t, err, ErrNoOperation)
	g := New(NewMemoryStore(MemoryOptions{}), Options{})
	var keys []string
	_, err = g.Do(context.Background(), Key{Name: "k"}, Fingerprint{}, func(ctx context.Context) (Response, error) {
		for _, name := range []string{"gateway", "ledger"} {
			k, err := DownstreamKey(ctx, name)
			require.NoError(t, err)
			keys = append(keys, k)
		}
		return Response{}, nil
	})
	require.NoError(t, err)
	assert.NotEqual(t, keys[0], keys[1], "one key per name")
	assert.Regexp(t, `^idem_[A-Z2-7]{32}$`, keys[0])
}

// Options.MaxWaiters bounds the duplicates that wait at once: past it a
// duplicate fails with ErrInFlight at once, and those waiting still get the
// original's answer. Guard.InFlight counts the owner and the waiter.
func TestMaxWaiters(t *testing.T) {
	ctx := context.Background()
	g := New(NewMemoryStore(MemoryOptions{}), Options{MaxWaiters: 1, WaitTimeout: 10 * time.Second})
	k, fp := Key{Name: "busy"}, FingerprintOf("charge", nil)
	started, finish := make(chan struct{}), make(chan struct{})
	original := make(chan error, 1)
	go func() {
		_, err := g.Do(ctx, k, fp, func(context.Context) (Response, error) {
			close(started)
			<-finish
			return Response{Status: 201}, nil
		})
		original <- err
	}()
	<-started
	never := func(context.Context) (Response, error) {
		t.Error("a duplicate ran the operation")
		return Response{}, nil
	}
	waiter := make(chan Result, 1)
	go func() {
		r, err := g.Do(ctx, k, fp, never)
		assert.NoError(t, err, "the waiter")
		waiter <- r
	}()
	require.Eventually(t, func() bool { return len(g.waiting) == 1 }, 5*time.Second, time.Millisecond, "the first duplicate never waited")
	ops, waiting := g.InFlight()
	assert.Equal(t, [2]int{1, 1}, [2]int{ops, waiting}, "InFlight while the original runs and one waits")

	_, err := g.Do(ctx, k, fp, never)
	require.ErrorIs(t, err, ErrInFlight, "a duplicate past MaxWaiters")
	assert.ErrorContains(t, err, "1 requests already waiting")

	close(finish)
	require.NoError(t, <-original)
	r := <-waiter
	assert.True(t, r.Replayed)
	assert.Equal(t, 201, r.Response.Status)
	ops, waiting = g.InFlight()
	assert.Equal(t, [2]int{0, 0}, [2]int{ops, waiting}, "InFlight once every call returned")
}
