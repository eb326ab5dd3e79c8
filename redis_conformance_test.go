package idempotency_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
	"github.com/idempotency-go/idempotency/internal/testkit/migrationtest"
	"github.com/idempotency-go/idempotency/internal/testkit/statstest"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// harnesses are the stores the Guard-level tests run on: memory and
// miniredis with clocks the test moves, and a real redis-server in real
// time.
func harnesses() map[string]func(t *testing.T) idempotencytest.Harness {
	return map[string]func(t *testing.T) idempotencytest.Harness{
		"memory": func(t *testing.T) idempotencytest.Harness {
			var mu sync.Mutex
			now := time.Date(2030, time.January, 1, 0, 0, 0, 0, time.UTC)
			s := idempotency.NewMemoryStore(idempotency.MemoryOptions{Now: func() time.Time {
				mu.Lock()
				defer mu.Unlock()
				return now
			}})
			return idempotencytest.Harness{Store: s, Advance: func(d time.Duration) {
				mu.Lock()
				now = now.Add(d)
				mu.Unlock()
			}}
		},
		"miniredis": miniredisHarness,
		"redis-server": func(t *testing.T) idempotencytest.Harness {
			return idempotencytest.Harness{Store: redisStore(t, testserver.StartRedis(t).Client())}
		},
	}
}

// miniredisHarness moves miniredis's clock: TIME follows SetTime and expiry
// follows FastForward, so Advance moves both.
func miniredisHarness(t *testing.T) idempotencytest.Harness {
	m := miniredis.RunT(t)
	now := time.Date(2030, time.January, 1, 0, 0, 0, 0, time.UTC)
	m.SetTime(now)
	// Under the race detector on a loaded machine, one of miniredis's
	// scripts can take longer than go-redis's default 3 s read timeout.
	s := redisStore(t, redis.NewClient(&redis.Options{Addr: m.Addr(), ReadTimeout: time.Minute, WriteTimeout: time.Minute}))
	return idempotencytest.Harness{Store: s, Advance: func(d time.Duration) {
		now = now.Add(d)
		m.SetTime(now)
		m.FastForward(d)
	}}
}

func redisStore(t *testing.T, c redis.UniversalClient) *idempotency.RedisStore {
	s, err := idempotency.NewRedisStore(c, idempotency.RedisOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close(); c.Close() })
	return s
}

func TestRedisStoreConformanceMiniredis(t *testing.T) {
	t.Parallel() // a server of its own: runs beside the other long suites
	idempotencytest.Run(t, miniredisHarness)
}

// The conformance suite on a real redis-server, in real time, all cases on
// one server and one store as in production.
func TestRedisStoreConformance(t *testing.T) {
	t.Parallel() // a server of its own: runs beside the other long suites
	s := redisStore(t, testserver.StartRedis(t).Client())
	idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
		return idempotencytest.Harness{Store: s}
	})
}

// Moving a service from the memory store to Redis without a gap.
func TestMigrationToRedis(t *testing.T) {
	migrationtest.Run(t, idempotency.NewMemoryStore(idempotency.MemoryOptions{}), miniredisHarness(t).Store)
}

// The store NewMigratingStore returns is a Store like any other: the whole suite runs on one
// from a MemoryStore to a redis-server, with DualWrite, so that every owner
// holds both records and a silent store is met on both paths.
func TestMigratingStoreConformance(t *testing.T) {
	t.Parallel() // a server of its own: runs beside the other long suites
	to := redisStore(t, testserver.StartRedis(t).Client())
	from := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	m := idempotency.NewMigratingStore(from, to, idempotency.MigrationOptions{DualWrite: true})
	idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
		return idempotencytest.Harness{Store: m}
	})
}

// TestStats checks the memory and Redis stores' Stats.
func TestStats(t *testing.T) {
	t.Run("memory", func(t *testing.T) { statstest.Check(t, idempotency.NewMemoryStore(idempotency.MemoryOptions{})) })
	t.Run("miniredis", func(t *testing.T) {
		statstest.Check(t, redisStore(t, redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})))
	})
	t.Run("redis-server", func(t *testing.T) {
		c := testserver.StartRedis(t).Client()
		s, err := idempotency.NewRedisStore(c, idempotency.RedisOptions{Prefix: fmt.Sprintf("stats%d:", time.Now().UnixNano())})
		require.NoError(t, err)
		t.Cleanup(func() { s.Close() })
		statstest.Check(t, s)
	})
}
