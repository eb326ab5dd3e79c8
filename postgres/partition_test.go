package postgres_test

import (
	"net/url"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testkit/leasetest"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
)

// Issue 10's lease discipline on PostgreSQL, with pgxpool's default
// options: nothing in them bounds a query on a silent connection, so the
// owner alone must stop in time.
func TestLeaseDiscipline(t *testing.T) {
	pg := testserver.StartPostgres(t)
	b, _ := leaseStore(t, pg.DSN)
	require.NoError(t, b.Migrate(t.Context()))
	rig := leasetest.Rig{Name: "postgres", B: b, A: func(t *testing.T, _ idempotency.Key) leasetest.Link {
		u, err := url.Parse(pg.DSN)
		require.NoError(t, err)
		p := faultproxy.Start(t, u.Host)
		u.Host = p.Addr()
		s, pool := leaseStore(t, u.String())
		return leasetest.Link{Store: s, Proxy: p, Dials: func() int { return int(pool.Stat().NewConnsCount()) }}
	}}
	t.Run("Partition", func(t *testing.T) { leasetest.Partitions(t, rig) })
	t.Run("LinkFaults", func(t *testing.T) { leasetest.LinkFaults(t, rig) })
}

// leaseStore is a Store on the default table, on a pool of its own.
func leaseStore(t *testing.T, dsn string) (*postgres.Store, *pgxpool.Pool) {
	pool, err := pgxpool.New(t.Context(), dsn)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	s := postgres.New(pool, postgres.Options{})
	t.Cleanup(s.Close)
	return s, pool
}
