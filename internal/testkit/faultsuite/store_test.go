package faultsuite

import (
	"net/url"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
)

// Every fault on a redis-server. The clients keep go-redis's defaults,
// timeouts and retries included, as in production.
func TestRedis(t *testing.T) {
	srv := testserver.StartRedis(t)
	tg := newTarget(t, "redis", []string{srv.Addr}, func(t *testing.T, dial dialFunc) idempotency.Store {
		return redisStore(t, redis.NewClient(&redis.Options{Addr: srv.Addr, Dialer: dial}))
	})
	for _, sc := range []scenario{latency, reset, timeout, bandwidth, partition} {
		t.Run(sc.name, func(t *testing.T) { tg.play(t, sc) })
	}
}

// The faults that break connections, drop replies and cut an instance off,
// on a Redis Cluster of three masters, with a proxy to each master per
// instance, so that every connection of a cluster client, its shard pub/sub
// ones included, meets them. Latency and bandwidth, which the cluster
// client meets as a standalone one does, are left to TestRedis.
func TestRedisCluster(t *testing.T) {
	cl := testserver.StartCluster(t, 3, 0)
	tg := newTarget(t, "redis-cluster", cl.Addrs, func(t *testing.T, dial dialFunc) idempotency.Store {
		return redisStore(t, redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs, Dialer: dial}))
	})
	for _, sc := range []scenario{reset, timeout, partition} {
		t.Run(sc.name, func(t *testing.T) { tg.play(t, sc) })
	}
}

// Every fault on PostgreSQL, with pgxpool's defaults but for the pool's
// size, which the load needs: the LISTEN connection is one of the pool's.
func TestPostgres(t *testing.T) {
	pg := testserver.StartPostgres(t)
	u, err := url.Parse(pg.DSN)
	if err != nil {
		t.Fatal(err)
	}
	migrated := false
	tg := newTarget(t, "postgres", []string{u.Host}, func(t *testing.T, dial dialFunc) idempotency.Store {
		cfg, err := pgxpool.ParseConfig(pg.DSN)
		if err != nil {
			t.Fatal(err)
		}
		cfg.MaxConns = 8
		cfg.ConnConfig.DialFunc = dial
		pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		s := postgres.New(pool, postgres.Options{})
		t.Cleanup(s.Close)
		if !migrated {
			if err := s.Migrate(t.Context()); err != nil {
				t.Fatal(err)
			}
			migrated = true
		}
		return s
	})
	for _, sc := range []scenario{latency, reset, timeout, bandwidth, partition} {
		t.Run(sc.name, func(t *testing.T) { tg.play(t, sc) })
	}
}

// redisStore is a RedisStore on c, both closed when t ends.
func redisStore(t *testing.T, c redis.UniversalClient) *idempotency.RedisStore {
	t.Helper()
	t.Cleanup(func() { c.Close() })
	s, err := idempotency.NewRedisStore(c, idempotency.RedisOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}
