package postgres_test

import (
	"context"
	"crypto/rand"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
	"github.com/idempotency-go/idempotency/internal/testkit/statstest"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
)

// securityDoc is the page whose "Least privilege: PostgreSQL" section holds
// the SQL that sets the roles up: the test runs the page's own blocks, so
// the page and the test cannot disagree.
const securityDoc = "../docs/security.md"

// The roles the page's SQL creates.
const (
	ownerRole = "idempotency_owner"
	appRole   = "idempotency_app"
)

// privilegeSQL is the page's SQL: what a superuser runs once, and what the
// owner runs after its Migrate.
type privilegeSQL struct{ superuser, owner string }

// docSQL reads the sql blocks of the page's PostgreSQL section; each says in
// its first line who runs it, and there must be one of each.
func docSQL(t *testing.T) privilegeSQL {
	t.Helper()
	b, err := os.ReadFile(securityDoc)
	require.NoError(t, err)
	_, section, ok := strings.Cut(string(b), "\n## Least privilege: PostgreSQL\n")
	require.True(t, ok, "%s has no section \"Least privilege: PostgreSQL\"", securityDoc)
	section, _, _ = strings.Cut(section, "\n## ")
	var sql privilegeSQL
	for _, block := range strings.Split(section, "```sql\n")[1:] {
		block, _, ok := strings.Cut(block, "```")
		require.True(t, ok, "%s: an sql block without its end", securityDoc)
		first, _, _ := strings.Cut(block, "\n")
		switch first {
		case "-- As a superuser, once.":
			require.Empty(t, sql.superuser, "%s: two blocks for the superuser", securityDoc)
			sql.superuser = block
		case "-- As " + ownerRole + ", after its Migrate.":
			require.Empty(t, sql.owner, "%s: two blocks for the owner", securityDoc)
			sql.owner = block
		default:
			t.Fatalf("%s: an sql block this test does not know, starting %q", securityDoc, first)
		}
	}
	require.NotEmpty(t, sql.superuser, "%s: no block for the superuser", securityDoc)
	require.NotEmpty(t, sql.owner, "%s: no block for the owner", securityDoc)
	sql.superuser = strings.ReplaceAll(sql.superuser, "'CHANGE-ME'", "'"+rand.Text()+"'")
	return sql
}

// poolAs is a pool on pg's postgres database that logs in as role (the
// server trusts every local login: the test is about grants, not
// passwords), closed when t ends.
func poolAs(t *testing.T, pg *testserver.Postgres, role string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pg.DSN)
	require.NoError(t, err)
	cfg.ConnConfig.User = role
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// TestLeastPrivilege sets the roles up with docs/security.md's SQL, the
// owner migrating the table, and runs the store as the runtime role: the
// conformance suite, CompleteTx, DeleteExpired through the delete trigger,
// Stats and the operator's reads. The runtime role may not migrate, nor
// change or empty the table, nor call the functions it was not granted.
func TestLeastPrivilege(t *testing.T) {
	pg := testserver.StartPostgres(t)
	ctx := t.Context()
	sql := docSQL(t)
	_, err := poolAs(t, pg, "postgres").Exec(ctx, sql.superuser)
	require.NoError(t, err, "the superuser's block")
	owner := poolAs(t, pg, ownerRole)
	require.NoError(t, postgres.New(owner, postgres.Options{}).Migrate(ctx), "Migrate as the owner")
	_, err = owner.Exec(ctx, sql.owner)
	require.NoError(t, err, "the owner's block")

	appPool := poolAs(t, pg, appRole)
	app := postgres.New(appPool, postgres.Options{})
	t.Cleanup(app.Close)
	t.Run("Stats", func(t *testing.T) { statstest.Check(t, app) })
	t.Run("Conformance", func(t *testing.T) {
		idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness { return idempotencytest.Harness{Store: app} })
	})
	t.Run("CompleteTx", func(t *testing.T) { privilegedCompleteTx(t, app, appPool) })
	t.Run("DeleteExpired", func(t *testing.T) { privilegedDeleteExpired(t, app, owner) })
	t.Run("MigrateRefused", func(t *testing.T) {
		err := app.Migrate(ctx)
		// CREATE TABLE IF NOT EXISTS asks for CREATE on the schema before
		// it looks for the table.
		assert.Equal(t, "permission denied for schema public", requireDenied(t, err, "Migrate as the runtime role").Message)
		assert.NotErrorIs(t, err, idempotency.ErrUnavailable, "a refusal no retry helps")
		assert.Contains(t, err.Error(), "run Migrate as the role that owns them")
	})
	t.Run("SchemaRefused", func(t *testing.T) {
		for _, stmt := range []string{
			"DROP TABLE idempotency_records",
			"TRUNCATE idempotency_records",
			"ALTER TABLE idempotency_records ADD COLUMN extra int",
			"CREATE TABLE extra (i int)",
			"SELECT idempotency_records_release('s', 'k', 1)",
		} {
			_, err := appPool.Exec(ctx, stmt)
			requireDenied(t, err, stmt)
		}
	})
}

// requireDenied checks that err is PostgreSQL's insufficient_privilege
// ("permission denied for …", "must be owner of …"), and returns it.
func requireDenied(t *testing.T, err error, what string) *pgconn.PgError {
	t.Helper()
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "%s: want a refusal, got %v", what, err)
	assert.Equal(t, "42501", pgErr.Code, "%s: %v", what, err)
	return pgErr
}

// privilegedCompleteTx completes a record through a Guard in a transaction
// of the runtime role's, after reading it as an operator does while the
// operation runs; a retry replays what the transaction committed.
func privilegedCompleteTx(t *testing.T, app *postgres.Store, pool *pgxpool.Pool) {
	ctx := t.Context()
	g := idempotency.New(app, idempotency.Options{Lease: 5 * time.Second, Retention: time.Hour})
	k, print := idempotency.Key{Scope: "privilege", Name: "complete-tx"}, fp("complete-tx")
	want := idempotency.Response{Status: 201, Body: []byte("charged in the caller's transaction")}
	op := func(ctx context.Context) (idempotency.Response, error) {
		rec, err := app.Inspect(ctx, k)
		require.NoError(t, err)
		assert.Equal(t, idempotency.RecordInFlight, rec.State)
		recs, _, err := app.ListInFlight(ctx, "", 100)
		require.NoError(t, err)
		assert.True(t, slicesContainKey(recs, k), "ListInFlight lists the record")
		tx, err := pool.Begin(ctx)
		if err != nil {
			return idempotency.Response{}, err
		}
		defer tx.Rollback(context.WithoutCancel(ctx))
		if err := app.CompleteTx(ctx, tx, want); err != nil {
			return idempotency.Response{}, err
		}
		return idempotency.Response{}, tx.Commit(ctx)
	}
	_, err := g.Do(ctx, k, print, op)
	require.NoError(t, err)
	got, err := g.Do(ctx, k, print, func(context.Context) (idempotency.Response, error) {
		t.Error("the retry ran the operation again")
		return idempotency.Response{}, nil
	})
	require.NoError(t, err)
	assert.True(t, got.Replayed)
	assert.Equal(t, want.Body, got.Response.Body)
	rec, err := app.Inspect(ctx, k)
	require.NoError(t, err)
	assert.Equal(t, idempotency.RecordCompleted, rec.State)
}

func slicesContainKey(recs []idempotency.Record, k idempotency.Key) bool {
	for _, r := range recs {
		if r.Key == k {
			return true
		}
	}
	return false
}

// privilegedDeleteExpired has the runtime role delete an expired record a
// waiter still watches: the table's delete trigger, whose function the role
// may not call itself, wakes the waiter.
func privilegedDeleteExpired(t *testing.T, app *postgres.Store, owner *pgxpool.Pool) {
	ctx := t.Context()
	k := idempotency.Key{Scope: "privilege", Name: "expired"}
	// Expired, and made, an hour ago: past DeleteExpired's grace.
	_, err := owner.Exec(ctx, `INSERT INTO idempotency_records (scope, key, fingerprint, state, attempt, operation_id,
		lease_until, waiters, created_at, expires_at)
		VALUES ($1, $2, '\x00', 'in_progress', 1, 'op', now(), true, now() - interval '1 hour', now() - interval '1 hour')`,
		k.Scope, k.Name)
	require.NoError(t, err)
	sub, err := app.Subscribe(ctx, k)
	require.NoError(t, err)
	defer sub.Close()
	n, err := app.DeleteExpired(ctx)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, n, int64(1))
	select {
	case <-sub.C():
	case <-time.After(5 * time.Second):
		t.Fatal("deleting the record woke no one")
	}
	var left bool
	require.NoError(t, owner.QueryRow(ctx, `SELECT EXISTS (SELECT FROM idempotency_records WHERE scope = $1 AND key = $2)`,
		k.Scope, k.Name).Scan(&left))
	assert.False(t, left, "the expired record is deleted")
}
