package idempotency_test

import (
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
	"github.com/idempotency-go/idempotency/internal/testserver"
)

// The conformance suite on miniredis, whose clock the suite moves: TIME
// follows SetTime and expiry follows FastForward, so Advance moves both.
func TestRedisStoreConformanceMiniredis(t *testing.T) {
	idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
		m := miniredis.RunT(t)
		now := time.Date(2030, time.January, 1, 0, 0, 0, 0, time.UTC)
		m.SetTime(now)
		c := redis.NewClient(&redis.Options{Addr: m.Addr()})
		s := idempotency.NewRedisStore(c, idempotency.RedisOptions{})
		t.Cleanup(func() { s.Close(); c.Close() })
		return idempotencytest.Harness{Store: s, Advance: func(d time.Duration) {
			now = now.Add(d)
			m.SetTime(now)
			m.FastForward(d)
		}}
	})
}

// The conformance suite on a real redis-server, in real time, all cases on
// one server and one store as in production.
func TestRedisStoreConformance(t *testing.T) {
	c := testserver.StartRedis(t).Client()
	s := idempotency.NewRedisStore(c, idempotency.RedisOptions{})
	t.Cleanup(func() { s.Close() })
	idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
		return idempotencytest.Harness{Store: s}
	})
}
