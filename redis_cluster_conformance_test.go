package idempotency_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// TestRedisCluster runs the conformance suite on a Redis Cluster of 3
// masters with a replica each, through a ClusterClient, and checks that the
// records spread over every master; then the store's own cluster tests run
// on the same cluster (see idempotency.ClusterTests).
func TestRedisCluster(t *testing.T) {
	t.Parallel() // a server of its own: runs beside the other long suites
	cl := testserver.StartCluster(t, 3, 1)
	t.Run("Conformance", func(t *testing.T) {
		cc := cl.Client()
		s := redisStore(t, cc)
		idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
			return idempotencytest.Harness{Store: s}
		})
		require.NoError(t, cc.ForEachMaster(context.Background(), func(ctx context.Context, c *redis.Client) error {
			if n, err := c.DBSize(ctx).Result(); err != nil || n == 0 {
				return fmt.Errorf("master %s holds %d keys (%v)", c.Options().Addr, n, err)
			}
			return nil
		}))
	})
	idempotency.ClusterTests(t, cl)
}
