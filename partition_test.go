package idempotency_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testkit/leasetest"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// Issue 10's lease discipline on a redis-server: an owner whose link is
// partitioned stops before a rival takes its record; latency and resets
// that its renewals survive cost it nothing. Clients keep go-redis's
// default options, timeouts and retries included: they are what a
// partition meets in production.
func TestLeaseDisciplineRedis(t *testing.T) {
	srv := testserver.StartRedis(t)
	rig := leasetest.Rig{Name: "redis-server", B: redisStore(t, srv.Client()),
		A: func(t *testing.T, _ idempotency.Key) leasetest.Link {
			p := faultproxy.Start(t, srv.Addr)
			c := redis.NewClient(&redis.Options{Addr: p.Addr()})
			return leasetest.Link{Store: redisStore(t, c), Proxy: p, Dials: func() int { return int(c.PoolStats().Misses) }}
		}}
	t.Run("Partition", func(t *testing.T) { leasetest.Partitions(t, rig) })
	t.Run("LinkFaults", func(t *testing.T) { leasetest.LinkFaults(t, rig) })
}

// The partition scenario on a Redis Cluster, where only the owner's link to
// the master that holds its key goes silent: the cluster client's other
// links, and its slot map, stay sound.
func TestLeaseDisciplineRedisCluster(t *testing.T) {
	cl := testserver.StartCluster(t, 3, 0)
	b := redisStore(t, cl.Client())
	// go-redis's own dialer, with the default dial timeout it is not given
	// when ClusterOptions.Dialer is set.
	dial := redis.NewDialer(&redis.Options{DialTimeout: 5 * time.Second})
	rig := leasetest.Rig{Name: "redis-cluster", B: b, A: func(t *testing.T, k idempotency.Key) leasetest.Link {
		master := cl.MasterFor(idempotency.RecordKey(b, k)).Addr
		p := faultproxy.Start(t, master)
		c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs,
			Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
				if addr == master {
					addr = p.Addr()
				}
				return dial(ctx, network, addr)
			}})
		return leasetest.Link{Store: redisStore(t, c), Proxy: p, Dials: func() int { return int(c.PoolStats().Misses) }}
	}}
	leasetest.Partitions(t, rig)
}
