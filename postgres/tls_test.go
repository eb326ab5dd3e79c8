package postgres_test

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
)

// TestTLS runs the store over TLS, as docs/security.md sets it up: a server
// that accepts TLS only, from clients with a certificate of the test's
// authority, and a pool that verifies the server's certificate and name
// (sslmode=verify-full, sslrootcert). Every connection of the pool, the
// LISTEN one included, is encrypted; one without TLS, one that trusts
// another authority, or one without a client certificate is refused.
func TestTLS(t *testing.T) {
	files := testserver.NewTLSFiles(t)
	pg := testserver.StartPostgresTLS(t, files)
	ctx := t.Context()
	pool, err := pgxpool.New(ctx, pg.TLSDSN(files))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	s := postgres.New(pool, postgres.Options{})
	require.NoError(t, s.Migrate(ctx))
	t.Cleanup(s.Close)

	idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness { return idempotencytest.Harness{Store: s} })
	_, err = s.DeleteExpired(ctx)
	require.NoError(t, err)

	// Every connection over TCP, the pool's and the store's LISTEN one
	// (which the suite's waiters made), is encrypted: the server admits no
	// other.
	var plain, encrypted int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE NOT s.ssl), count(*) FILTER (WHERE s.ssl)
		FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.client_addr IS NOT NULL`).Scan(&plain, &encrypted))
	assert.Zero(t, plain, "connections over TCP without TLS")
	assert.GreaterOrEqual(t, encrypted, 2, "the pool's connection and the LISTEN one, over TLS")

	for name, dsn := range map[string]string{
		"no TLS": pg.DSN,
		"another authority": strings.Replace(pg.TLSDSN(files), "sslrootcert="+files.CA,
			"sslrootcert="+testserver.NewTLSFiles(t).CA, 1),
		"no client certificate": strings.Split(pg.TLSDSN(files), "&sslcert=")[0],
	} {
		s := postgres.New(mustPool(t, dsn), postgres.Options{})
		_, err := s.Claim(ctx, idempotency.ClaimRequest{Key: key(name), Fingerprint: fp(name), OperationID: "op",
			Lease: longLease, Retention: longRetention})
		assert.ErrorIs(t, err, idempotency.ErrUnavailable, "%s: the claim is refused", name)
		s.Close()
	}
}

// mustPool is a pool on dsn that connects lazily, closed when t ends.
func mustPool(t *testing.T, dsn string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(t.Context(), dsn)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}
