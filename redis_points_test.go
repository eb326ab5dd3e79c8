package idempotency

import (
	"context"
	"regexp"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/wire"
)

// pointsOwner claims k for a new record by id, for the tests of recovery
// points.
func pointsOwner(t *testing.T, s *RedisStore, k Key, id string, retention time.Duration) Claim {
	t.Helper()
	c, err := s.Claim(context.Background(), ClaimRequest{Key: k, Fingerprint: FingerprintOf("charge", nil), OperationID: id,
		Lease: time.Minute, Retention: retention})
	require.NoError(t, err)
	require.Equal(t, Owner, c.State)
	return c
}

// pointsOf is the value lua/record.lua lays out for the recovery points of
// the record whose operation ID is op: its marker, op, then entries.
func pointsOf(t *testing.T, op string, entries ...RecoveryPoint) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^local POINTS = '(.)'$`).FindStringSubmatch(recordLua)
	require.NotNil(t, m, "lua/record.lua names no POINTS marker")
	b := []byte(m[1] + string(rune(len(op))) + op)
	for _, p := range entries {
		b = wire.AppendPoint(b, p.Step, p.Result)
	}
	return string(b)
}

// TestRecoveryPointsLayout: a record's recovery points are one value under
// the points key, a marker that is no record's state, the operation ID,
// then every save's entry in the order sent, a resend's too, which the
// reader skips.
func TestRecoveryPointsLayout(t *testing.T) {
	marker := pointsOf(t, "")[:1]
	assert.NotContains(t, []string{string(rune(recordCompleted)), string(rune(recordInFlight)), string(rune(recordReleased))}, marker,
		"the points' marker is a record's state")
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		ctx := context.Background()
		s := newRedisStore(t, c)
		k := Key{Scope: "acct", Name: "points-layout"}
		owner := pointsOwner(t, s, k, "op-1", time.Hour)
		order, charge := RecoveryPoint{Step: "order", Result: []byte(`{"id":1}`)}, RecoveryPoint{Step: "charge", Result: []byte{}}
		for _, p := range []RecoveryPoint{order, charge, {Step: "order", Result: []byte(`"resent"`)}} {
			require.NoError(t, s.SaveRecoveryPoint(ctx, k, owner.Token, p))
		}
		ks, _ := s.keysOf(k)
		v, err := c.Get(ctx, ks.points).Result()
		require.NoError(t, err)
		assert.Equal(t, pointsOf(t, "op-1", order, charge, RecoveryPoint{Step: "order", Result: []byte(`"resent"`)}), v)
		got, err := s.RecoveryPoints(ctx, k, owner.Token)
		require.NoError(t, err)
		assert.Equal(t, []RecoveryPoint{order, charge}, got)
	})
}

// TestRecoveryPointsOfAnEarlierRecord: points under the key whose operation
// ID is not the record's (an earlier record's of the same key, which
// expired or was forgotten without them), or that are not laid out as
// points at all, count as none: a read returns none, and a save replaces
// them.
func TestRecoveryPointsOfAnEarlierRecord(t *testing.T) {
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		ctx := context.Background()
		s := newRedisStore(t, c)
		old := RecoveryPoint{Step: "order", Result: []byte(`"old"`)}
		for i, stale := range []string{
			pointsOf(t, "op-old", old),
			pointsOf(t, "op-ne", old),       // the record's ID less its last byte
			pointsOf(t, "op-newer", old),    // the record's ID and more
			"p" + pointsOf(t, "op-new")[1:], // the record's ID, not after the marker
		} {
			k := Key{Scope: "acct", Name: "earlier-" + string(rune('a'+i))}
			owner := pointsOwner(t, s, k, "op-new", time.Hour)
			ks, _ := s.keysOf(k)
			require.NoError(t, c.Set(ctx, ks.points, stale, time.Hour).Err())
			got, err := s.RecoveryPoints(ctx, k, owner.Token)
			require.NoError(t, err)
			assert.Empty(t, got, "points %q read by the record of op-new", stale)

			charge := RecoveryPoint{Step: "charge", Result: []byte(`"new"`)}
			require.NoError(t, s.SaveRecoveryPoint(ctx, k, owner.Token, charge))
			assert.Equal(t, pointsOf(t, "op-new", charge), c.Get(ctx, ks.points).Val(), "points %q saved over", stale)
			got, err = s.RecoveryPoints(ctx, k, owner.Token)
			require.NoError(t, err)
			assert.Equal(t, []RecoveryPoint{charge}, got)
		}
	})
}

// TestRecoveryPointsExpireWithTheRecord: the points key expires when the
// record does, through a save, a renewal that moves the record's expiry and
// a takeover that extends it; a release keeps the points, a completion and
// a forgetting delete them.
func TestRecoveryPointsExpireWithTheRecord(t *testing.T) {
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		ctx := context.Background()
		s := newRedisStore(t, c)
		k := Key{Scope: "acct", Name: "points-expiry"}
		ks, _ := s.keysOf(k)
		// expiresWithRecord reads both keys' time to live in one script, on
		// one clock.
		ttls := redis.NewScript(`return {redis.call('PTTL', KEYS[1]), redis.call('PTTL', KEYS[2])}`)
		expiresWithRecord := func(what string, atLeast time.Duration) {
			t.Helper()
			v, err := ttls.Run(ctx, c, []string{ks.rec, ks.points}).Int64Slice()
			require.NoError(t, err)
			rec, pts := v[0], v[1]
			assert.GreaterOrEqual(t, rec, atLeast.Milliseconds()-1000, "%s: the record's time to live", what)
			assert.True(t, pts >= rec && pts <= rec+2, "%s: the points live %d ms, the record %d ms", what, pts, rec)
		}
		save := func(token uint64, step string) {
			t.Helper()
			require.NoError(t, s.SaveRecoveryPoint(ctx, k, token, RecoveryPoint{Step: step, Result: []byte(`1`)}))
		}

		first := pointsOwner(t, s, k, "op-1", 10*time.Second)
		save(first.Token, "order")
		expiresWithRecord("a save", 10*time.Second)
		require.NoError(t, s.Heartbeat(ctx, k, first.Token, time.Hour))
		expiresWithRecord("a renewal past the retention", time.Hour)
		require.NoError(t, s.Release(ctx, k, first.Token))
		expiresWithRecord("a release", time.Hour)

		second := pointsOwner(t, s, k, "op-2", 2*time.Hour)
		require.Equal(t, 2, second.Attempt)
		expiresWithRecord("a takeover that extends the retention", 2*time.Hour)
		save(second.Token, "charge")
		require.NoError(t, s.Complete(ctx, k, second.Token, Response{Status: 201}, time.Hour))
		assert.Zero(t, c.Exists(ctx, ks.points).Val(), "the points of a completed record")

		forgotten := Key{Scope: "acct", Name: "points-forgotten"}
		third := pointsOwner(t, s, forgotten, "op-3", time.Hour)
		require.NoError(t, s.SaveRecoveryPoint(ctx, forgotten, third.Token, RecoveryPoint{Step: "order"}))
		require.NoError(t, s.Forget(ctx, forgotten, third.Token))
		fks, _ := s.keysOf(forgotten)
		assert.Zero(t, c.Exists(ctx, fks.points).Val(), "the points of a forgotten record")
	})
}

// TestRecoveryPointSavesWaitForReplicas: with RedisOptions.Replicas set, a
// save goes out with a WAIT, and one that too few replicas confirm fails
// with ErrUnavailable, though the master keeps it.
func TestRecoveryPointSavesWaitForReplicas(t *testing.T) {
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		ctx := context.Background()
		s := newRedisStore(t, c)
		waits := newRedisStoreWith(t, c, RedisOptions{Replicas: 1, ReplicaTimeout: 5 * time.Millisecond})
		k := Key{Scope: "acct", Name: "points-replicas"}
		owner := pointsOwner(t, s, k, "op-1", time.Hour)
		order := RecoveryPoint{Step: "order", Result: []byte(`1`)}
		assert.ErrorIs(t, waits.SaveRecoveryPoint(ctx, k, owner.Token, order), ErrUnavailable, "a save no replica confirmed")
		got, err := s.RecoveryPoints(ctx, k, owner.Token)
		require.NoError(t, err)
		assert.Equal(t, []RecoveryPoint{order}, got)
	})
}
