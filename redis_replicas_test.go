package idempotency

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// TestRedisReplicas runs a store with Replicas: 1 on a primary with one
// replica: what decides an operation is confirmed by the replica in the
// same round trip, a replay does not need it, and a claim the replica does
// not confirm never runs the operation.
func TestRedisReplicas(t *testing.T) {
	primary := testserver.StartRedis(t)
	replica := testserver.StartRedis(t, "--replicaof", "127.0.0.1", strconv.Itoa(primary.Port))
	rc, pc := replica.Client(), primary.Client()
	ctx := context.Background()
	// The primary streams to a new replica, and so can count it in WAIT,
	// only after the replica's first acknowledgement, up to a second after
	// the sync.
	conn := pc.Conn()
	defer conn.Close()
	require.Eventually(t, func() bool {
		return conn.Incr(ctx, "ready").Err() == nil && conn.Wait(ctx, 1, 100*time.Millisecond).Val() == 1
	}, 10*time.Second, 10*time.Millisecond)
	// A timeout a loaded machine's replica meets where it must confirm, and
	// a short one where it must not.
	s, err := NewRedisStore(pc, RedisOptions{Replicas: 1, ReplicaTimeout: 2 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	g := New(s, Options{})
	short, err := NewRedisStore(pc, RedisOptions{Replicas: 1, ReplicaTimeout: 500 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { short.Close() })
	frozen := New(short, Options{})
	fp := FingerprintOf("charge", nil)
	var runs atomic.Int32
	charge := func(context.Context) (Response, error) {
		runs.Add(1)
		return Response{Status: 201, Body: []byte("charged")}, nil
	}

	t.Run("Confirmed", func(t *testing.T) {
		k := Key{Name: "confirmed"}
		_, err := g.Do(ctx, k, fp, charge) // loads the scripts
		require.NoError(t, err)
		k = Key{Name: "confirmed-counted"}
		assert.Equal(t, map[string]int{"evalsha": 2, "wait": 2}, countCommands(t, primary.Addr, func() {
			_, err := g.Do(ctx, k, fp, charge)
			require.NoError(t, err)
		}), "new operation: claim and completion, each confirmed")
		rec, _ := s.recordKey(k)
		// A completed record is one string starting with "c" (see claim.lua).
		assert.Equal(t, "c", rc.GetRange(ctx, rec, 0, 0).Val(), "the replica holds the completion once Do returns")
		assert.Equal(t, map[string]int{"evalsha": 1, "wait": 1}, countCommands(t, primary.Addr, func() {
			r, err := g.Do(ctx, k, fp, charge)
			require.NoError(t, err)
			require.True(t, r.Replayed)
		}), "replay: one round trip")
		// A replay changes nothing, so it does not need the replica.
		replica.Pause(t)
		r, err := g.Do(ctx, k, fp, charge)
		replica.Resume(t)
		require.NoError(t, err)
		assert.True(t, r.Replayed)
		assert.Equal(t, int32(2), runs.Load())
	})

	t.Run("Batched", func(t *testing.T) {
		c := primary.Client()
		batchedCalls(t, c, RedisOptions{Replicas: 1, ReplicaTimeout: 2 * time.Second},
			func(ctx context.Context) error { return c.ScriptFlush(ctx).Err() })
	})

	// A claim the frozen replica cannot confirm fails closed, and gives the
	// record up as it found it: nothing ran, so a created record is
	// deleted and a released one released again; an abandoned one stays
	// abandoned, since its earlier attempt may have acted.
	plain := newRedisStore(t, pc)
	for _, tc := range []struct {
		name    string
		prepare func(k Key) // as plain, before the durable claim
		next    Claim       // the claim after the failed one, as plain
	}{
		{"New", func(Key) {}, Claim{State: Owner, Attempt: 1}},
		{"Released", func(k Key) {
			c := ownFor(t, plain, k, fp)
			require.NoError(t, plain.Release(ctx, k, c.Token))
		}, Claim{State: Owner, Attempt: 3}},
		{"Abandoned", func(k Key) {
			c := ownFor(t, plain, k, fp)
			require.NoError(t, plain.Abandon(ctx, k, c.Token))
		}, Claim{State: Owner, Attempt: 3, Abandoned: true}},
	} {
		t.Run("Unconfirmed"+tc.name, func(t *testing.T) {
			k := Key{Name: "unconfirmed-" + tc.name}
			tc.prepare(k)
			before := runs.Load()
			replica.Pause(t)
			_, err := frozen.Do(ctx, k, fp, charge)
			replica.Resume(t)
			require.ErrorIs(t, err, ErrUnavailable)
			assert.ErrorContains(t, err, "0 of 1 replicas acknowledged within 500ms")
			assert.Equal(t, before, runs.Load(), "the operation ran")

			c := ownFor(t, plain, k, fp)
			assert.Equal(t, tc.next, Claim{State: c.State, Attempt: c.Attempt, Abandoned: c.Abandoned})
		})
	}

	t.Run("UnconfirmedCompletion", func(t *testing.T) {
		k := Key{Name: "unconfirmed-completion"}
		_, err := g.Do(ctx, k, fp, func(ctx context.Context) (Response, error) {
			replica.Pause(t)
			return charge(ctx)
		})
		replica.Resume(t)
		require.ErrorIs(t, err, ErrUnavailable, "a completion not confirmed is not reported as done")
		r, err := g.Do(ctx, k, fp, charge)
		require.NoError(t, err)
		assert.True(t, r.Replayed, "yet the primary keeps it")
		assert.Equal(t, "charged", string(r.Response.Body))
	})
}

// TestRedisReplicasMisconfigured: Replicas cannot be asked with a wait that
// the client would time out.
func TestRedisReplicasMisconfigured(t *testing.T) {
	c := redis.NewClient(&redis.Options{ReadTimeout: time.Second})
	defer c.Close()
	_, err := NewRedisStore(c, RedisOptions{Replicas: 1})
	assert.ErrorContains(t, err, "ReplicaTimeout 1s is not below the client's ReadTimeout 1s", "default ReplicaTimeout, 1s")
	s, err := NewRedisStore(c, RedisOptions{Replicas: 1, ReplicaTimeout: 900 * time.Millisecond})
	require.NoError(t, err)
	s.Close()
	cc := redis.NewClusterClient(&redis.ClusterOptions{ReadTimeout: time.Second})
	defer cc.Close()
	_, err = NewRedisStore(cc, RedisOptions{Replicas: 1, ReplicaTimeout: 2 * time.Second})
	assert.ErrorContains(t, err, "is not below the client's ReadTimeout")
}
