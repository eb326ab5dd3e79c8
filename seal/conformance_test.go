package seal_test

import (
	"crypto/rand"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/seal"
)

// newKey returns a sealing key of id with a random secret.
func newKey(id uint32) seal.Key {
	k := seal.Key{ID: id}
	_, _ = rand.Read(k.Secret[:])
	return k
}

func sealed(t testing.TB, inner idempotency.Store, keys seal.Keys) *seal.Store {
	t.Helper()
	s, err := seal.New(inner, keys)
	require.NoError(t, err)
	return s
}

// memoryHarness is a sealed MemoryStore on a clock the suite moves.
func memoryHarness(t *testing.T) idempotencytest.Harness {
	var mu sync.Mutex
	now := time.Date(2030, time.January, 1, 0, 0, 0, 0, time.UTC)
	inner := idempotency.NewMemoryStore(idempotency.MemoryOptions{Now: func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		return now
	}})
	return idempotencytest.Harness{Store: sealed(t, inner, seal.Keys{Current: newKey(2), Earlier: []seal.Key{newKey(1)}}),
		Advance: func(d time.Duration) {
			mu.Lock()
			now = now.Add(d)
			mu.Unlock()
		}}
}

func TestSealConformanceMemory(t *testing.T) {
	t.Parallel()
	idempotencytest.Run(t, memoryHarness)
}

// redisStore is a RedisStore on c, closed with the test; compressAbove is
// its RedisOptions.CompressAbove.
func redisStore(t testing.TB, c redis.UniversalClient, compressAbove int) *idempotency.RedisStore {
	t.Helper()
	s, err := idempotency.NewRedisStore(c, idempotency.RedisOptions{CompressAbove: compressAbove})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close(); c.Close() })
	return s
}

// The suite on a real redis-server, in real time, one sealed store for
// every case as in production, with every body compressed where that
// would make it smaller (sealed bodies never are: the store keeps them as
// they are).
func TestSealConformanceRedis(t *testing.T) {
	t.Parallel()
	s := sealed(t, redisStore(t, testserver.StartRedis(t).Client(), 1), seal.Keys{Current: newKey(7)})
	idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
		return idempotencytest.Harness{Store: s}
	})
}

// The suite on a Redis Cluster of three masters.
func TestSealConformanceRedisCluster(t *testing.T) {
	t.Parallel()
	c := testserver.StartCluster(t, 3, 0)
	s := sealed(t, redisStore(t, redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs}), 0), seal.Keys{Current: newKey(7)})
	idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
		return idempotencytest.Harness{Store: s}
	})
}
