package postgres_test

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
	"github.com/idempotency-go/idempotency/internal/testkit/migrationtest"
	"github.com/idempotency-go/idempotency/internal/testkit/statstest"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const (
	longLease     = time.Minute
	longRetention = time.Hour
	wakeTimeout   = 5 * time.Second
	claimers      = 50
)

// TestStore runs every case against one PostgreSQL server; each case has
// tables of its own.
func TestStore(t *testing.T) {
	pg := testserver.StartPostgres(t)
	cfg, err := pgxpool.ParseConfig(pg.DSN)
	require.NoError(t, err)
	cfg.MaxConns = claimers + 10 // every claimer of a race holds a connection at once
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	f := &fixture{pool: pool}

	cases := []struct {
		name string
		run  func(*testing.T, *fixture)
	}{
		{"Conformance", func(t *testing.T, f *fixture) {
			t.Parallel() // beside SimpleProtocolPool, which has a pool of its own
			idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
				s, _ := f.store(t)
				return idempotencytest.Harness{Store: s}
			})
		}},
		{"ConcurrentClaimsOnExpiredRecord", testConcurrentClaimsOnExpiredRecord},
		{"CompleteTxRollback", testCompleteTxRollback},
		{"CompleteTxCommit", testCompleteTxCommit},
		{"GuardWithCompleteTx", testGuardWithCompleteTx},
		{"CompleteTxOutlivesLease", testCompleteTxOutlivesLease},
		{"CompleteTxAfterLease", testCompleteTxAfterLease},
		{"CompleteTxMiddleware", testCompleteTxMiddleware},
		{"CompleteTxFailures", testCompleteTxFailures},
		{"CompleteTxWrongContext", testCompleteTxWrongContext},
		{"CompleteTxTakeover", testCompleteTxTakeover},
		{"StepTxCommit", testStepTxCommit},
		{"StepTxRollback", testStepTxRollback},
		{"StepTxWrongContext", testStepTxWrongContext},
		{"StepTxLostLease", testStepTxLostLease},
		{"DeleteExpired", testDeleteExpired},
		{"ForgottenRecordGrace", testForgottenRecordGrace},
		{"SlowClaimDrawsAgain", testSlowClaimDrawsAgain},
		{"ListenerReconnect", testListenerReconnect},
		{"MigrateConcurrently", testMigrateConcurrently},
		{"MigrateUpgrade", testMigrateUpgrade},
		{"MigrateRecoveryPoints", testMigrateRecoveryPoints},
		{"RollingUpgrade", testRollingUpgrade},
		{"TakeoverWaitsOutRelease", testTakeoverWaitsOutRelease},
		{"AbandonedCorruptFingerprint", testAbandonedCorruptFingerprint},
		{"ErrorsAreUnavailable", testErrorsAreUnavailable},
		{"PointsSurviveTakeovers", testPointsSurviveTakeovers},
		{"OwnerWritesPrepared", testOwnerWritesPrepared},
		{"OwnerWriteInTxLostStatement", testOwnerWriteInTxLostStatement},
		{"SimpleProtocolPool", testSimpleProtocolPool},
		{"CorruptRows", testCorruptRows},
		{"Stats", func(t *testing.T, f *fixture) {
			s, _ := f.store(t)
			statstest.Check(t, s)
		}},
		{"MigrationToRedis", func(t *testing.T, f *fixture) {
			// The zero-gap swap from a PostgreSQL table to Redis.
			old, _ := f.store(t)
			redis, err := idempotency.NewRedisStore(testserver.StartRedis(t).Client(), idempotency.RedisOptions{})
			require.NoError(t, err)
			t.Cleanup(func() { redis.Close() })
			migrationtest.Run(t, old, redis)
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { c.run(t, f) })
	}
}

type fixture struct {
	pool   *pgxpool.Pool
	tables atomic.Int64
}

// store returns a migrated Store on a table and channel of its own.
func (f *fixture) store(t *testing.T) (*postgres.Store, postgres.Options) {
	return f.storeOn(t, f.pool)
}

// storeOn is store on pool.
func (f *fixture) storeOn(t *testing.T, pool *pgxpool.Pool) (*postgres.Store, postgres.Options) {
	o := f.options()
	s := postgres.New(pool, o)
	require.NoError(t, s.Migrate(t.Context()))
	t.Cleanup(s.Close)
	return s, o
}

// options names a table and channel no other Store uses.
func (f *fixture) options() postgres.Options {
	n := f.tables.Add(1)
	return postgres.Options{Table: fmt.Sprintf("records_%d", n), Channel: fmt.Sprintf("wake_%d", n)}
}

func fp(s string) idempotency.Fingerprint { return idempotency.FingerprintOf("test", []byte(s)) }

func key(name string) idempotency.Key { return idempotency.Key{Scope: "acct_1", Name: name} }

func request(name string, lease time.Duration) idempotency.ClaimRequest {
	return idempotency.ClaimRequest{Key: key(name), Fingerprint: fp(name),
		OperationID: "op_" + name, Lease: lease, Retention: longRetention}
}

func claim(t *testing.T, s idempotency.Store, req idempotency.ClaimRequest) idempotency.Claim {
	t.Helper()
	c, err := s.Claim(t.Context(), req)
	require.NoError(t, err)
	return c
}

// claimUntil claims until the answer is want, which a lease running out
// on the database's clock will bring within wakeTimeout.
func claimUntil(t *testing.T, s idempotency.Store, req idempotency.ClaimRequest, want idempotency.ClaimState) idempotency.Claim {
	t.Helper()
	deadline := time.Now().Add(wakeTimeout)
	for {
		c := claim(t, s, req)
		if c.State == want {
			return c
		}
		require.True(t, time.Now().Before(deadline), "claim still answers %v, want %v", c.State, want)
		time.Sleep(20 * time.Millisecond)
	}
}

func requireWoken(t *testing.T, sub idempotency.Subscription) {
	t.Helper()
	select {
	case <-sub.C():
	case <-time.After(wakeTimeout):
		t.Fatalf("not woken within %v", wakeTimeout)
	}
}

// drain discards a wake-up that is already pending.
func drain(sub idempotency.Subscription) {
	select {
	case <-sub.C():
	default:
	}
}

var okResponse = idempotency.Response{Status: http.StatusCreated,
	Header: http.Header{"Content-Type": {"application/json"}, "X-Multi": {"a", "b"}}, Body: []byte(`{"id":"ch_1"}`)}

// Many claimers racing for a record whose retention ran out make exactly one
// new record in its place, whatever their fingerprints; the suite's races
// cover new, released and taken-over records.
func testConcurrentClaimsOnExpiredRecord(t *testing.T, f *fixture) {
	s, _ := f.store(t)
	ctx := t.Context()
	const keys = 3
	first := make([]idempotency.Claim, keys)
	for i := range keys {
		req := request(fmt.Sprintf("k%d", i), longLease)
		req.Retention = 200 * time.Millisecond
		first[i] = claim(t, s, req)
		require.Equal(t, idempotency.Owner, first[i].State)
	}
	time.Sleep(300 * time.Millisecond) // the records expire

	for i := range keys {
		start := make(chan struct{})
		reqs := make([]idempotency.ClaimRequest, claimers)
		results := make([]idempotency.Claim, claimers)
		errs := make([]error, claimers)
		var wg sync.WaitGroup
		for j := range claimers {
			reqs[j] = request(fmt.Sprintf("k%d", i), longLease)
			reqs[j].OperationID = fmt.Sprintf("op_%d", j)
			reqs[j].Fingerprint = fp(fmt.Sprintf("request %d", j%2))
			wg.Go(func() {
				<-start
				results[j], errs[j] = s.Claim(ctx, reqs[j])
			})
		}
		close(start)
		wg.Wait()
		owner := -1
		for j, c := range results {
			require.NoError(t, errs[j])
			if c.State == idempotency.Owner {
				require.Equal(t, -1, owner, "claims %d and %d both own key %d", owner, j, i)
				owner = j
			}
		}
		require.NotEqual(t, -1, owner, "no claim of key %d became the owner", i)
		won := results[owner]
		assert.Equal(t, reqs[owner].OperationID, won.OperationID, "the new record has the winner's operation ID")
		assert.Equal(t, 1, won.Attempt)
		assert.Greater(t, won.Token, first[i].Token)
		for j, c := range results {
			switch {
			case j == owner:
			case reqs[j].Fingerprint == reqs[owner].Fingerprint:
				assert.Equal(t, idempotency.InFlight, c.State, "claim %d", j)
			default:
				assert.Equal(t, idempotency.Mismatch, c.State, "claim %d", j)
			}
		}
	}
}

// charges creates a business table next to the store's.
func charges(t *testing.T, f *fixture, o postgres.Options) string {
	table := "charges_" + o.Table
	_, err := f.pool.Exec(t.Context(), "CREATE TABLE "+table+" (operation_id text PRIMARY KEY, amount integer NOT NULL)")
	require.NoError(t, err)
	return table
}

func count(t *testing.T, f *fixture, table string) int {
	t.Helper()
	var n int
	require.NoError(t, f.pool.QueryRow(t.Context(), "SELECT count(*) FROM "+table).Scan(&n))
	return n
}

// charge makes the business write of an attempt and completes its record in
// one transaction, which the caller commits or rolls back.
func charge(t *testing.T, f *fixture, s *postgres.Store, table string, k idempotency.Key, c idempotency.Claim) (pgx.Tx, error) {
	t.Helper()
	tx, err := f.pool.Begin(t.Context())
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	_, err = tx.Exec(t.Context(), "INSERT INTO "+table+" (operation_id, amount) VALUES ($1, 100)", c.OperationID)
	require.NoError(t, err)
	return tx, s.CompleteTxAs(t.Context(), tx, k, c.Token, okResponse, longRetention)
}

// Through Guard.Do, as an application uses it: the operation writes the
// charge and completes the record in one transaction, and tells the Guard
// with Settled. Concurrent duplicates wait and replay; the charge is
// written once; an operation whose transaction fails writes nothing and the
// retry, with the same operation ID, does it.
func testGuardWithCompleteTx(t *testing.T, f *fixture) {
	s, o := f.store(t)
	table := charges(t, f, o)
	g := idempotency.New(s, idempotency.Options{Lease: 2 * time.Second, Retention: longRetention, RecheckInterval: 50 * time.Millisecond})
	k, print := key("guarded"), fp("guarded")
	var runs atomic.Int32
	failFirst := true
	fn := chargeInTx(f, s, table, func(context.Context) error {
		runs.Add(1)
		if failFirst {
			failFirst = false
			return errors.New("the business transaction failed")
		}
		return nil
	})
	_, err := g.Do(t.Context(), k, print, fn)
	require.ErrorContains(t, err, "business transaction failed")
	assert.Zero(t, count(t, f, table), "the failed attempt wrote nothing")

	var wg sync.WaitGroup
	results := make([]idempotency.Result, 10)
	for i := range results {
		wg.Go(func() {
			r, err := g.Do(t.Context(), k, print, fn)
			assert.NoError(t, err)
			results[i] = r
		})
	}
	wg.Wait()
	assert.Equal(t, int32(2), runs.Load(), "the failed attempt and one retry")
	assert.Equal(t, 1, count(t, f, table))
	replays := 0
	for _, r := range results {
		assert.Equal(t, results[0].Response.Body, r.Response.Body)
		if r.Replayed {
			replays++
		}
	}
	assert.Equal(t, len(results)-1, replays)
	var op string
	require.NoError(t, f.pool.QueryRow(t.Context(), "SELECT operation_id FROM "+table).Scan(&op))
	assert.Equal(t, op, string(results[0].Response.Body), "the retry kept the operation ID")
}

// A transaction held open after CompleteTx for longer than the lease: the
// owner's renewals wait on the completed row's lock, its lease ends locally,
// and the commit, made with the operation's context, does not happen. Nothing
// is written, the record stays the owner's until its lease runs out on the
// database, and the retry then charges once.
func testCompleteTxOutlivesLease(t *testing.T, f *fixture) {
	s, o := f.store(t)
	table := charges(t, f, o)
	const lease = 600 * time.Millisecond
	g := idempotency.New(s, idempotency.Options{Lease: lease, Retention: longRetention, WaitTimeout: -1})
	k, print := key("long-tx"), fp("long-tx")
	var held time.Duration
	_, err := g.Do(t.Context(), k, print, chargeInTx(f, s, table, func(ctx context.Context) error {
		began := time.Now()
		select {
		case <-ctx.Done():
		case <-time.After(wakeTimeout):
		}
		held = time.Since(began)
		return nil
	}))
	require.ErrorIs(t, err, idempotency.ErrFenced, "Do whose transaction outlived the lease")
	assert.Less(t, held, lease, "the lease did not end while the transaction was open")
	assert.Zero(t, count(t, f, table), "the transaction committed after the lease ended locally")

	var runs int
	retry := chargeInTx(f, s, table, func(context.Context) error { runs++; return nil })
	require.Eventually(t, func() bool {
		_, err := g.Do(t.Context(), k, print, retry)
		return err == nil
	}, wakeTimeout, 50*time.Millisecond, "the retry never ran")
	assert.Equal(t, 1, runs, "runs of the retry")
	assert.Equal(t, 1, count(t, f, table), "charges")
}

// chargeInTx is an operation for Guard.Do that writes a charge and
// completes k's record in one transaction, answering with the operation ID.
// Before it commits, with the operation's context, it calls beforeCommit,
// whose error rolls the transaction back and is the operation's. It returns
// no response of its own: the Guard answers with the one committed.
func chargeInTx(f *fixture, s *postgres.Store, table string, beforeCommit func(ctx context.Context) error) func(context.Context) (idempotency.Response, error) {
	return func(ctx context.Context) (idempotency.Response, error) {
		info, _ := idempotency.FromContext(ctx)
		tx, err := f.pool.Begin(ctx)
		if err != nil {
			return idempotency.Response{}, err
		}
		defer tx.Rollback(context.Background())
		if _, err := tx.Exec(ctx, "INSERT INTO "+table+" (operation_id, amount) VALUES ($1, 100)", info.OperationID); err != nil {
			return idempotency.Response{}, err
		}
		resp := idempotency.Response{Status: 201, Body: []byte(info.OperationID)}
		if err := s.CompleteTx(ctx, tx, resp); err != nil {
			return idempotency.Response{}, err
		}
		if err := beforeCommit(ctx); err != nil {
			return idempotency.Response{}, err
		}
		return idempotency.Response{}, tx.Commit(ctx)
	}
}

// CompleteTx is refused once the owner's lease has run out by the database's
// clock, though no claim has taken the record over yet, and though the
// caller's transaction began while the lease was live.
func testCompleteTxAfterLease(t *testing.T, f *fixture) {
	s, o := f.store(t)
	table := charges(t, f, o)
	req := request("stale", 200*time.Millisecond)
	owner := claim(t, s, req)
	require.Equal(t, idempotency.Owner, owner.State)
	tx, err := f.pool.Begin(t.Context())
	require.NoError(t, err)
	defer tx.Rollback(context.Background())
	_, err = tx.Exec(t.Context(), "INSERT INTO "+table+" (operation_id, amount) VALUES ($1, 100)", owner.OperationID)
	require.NoError(t, err)
	time.Sleep(300 * time.Millisecond)
	err = s.CompleteTxAs(t.Context(), tx, req.Key, owner.Token, okResponse, longRetention)
	require.ErrorIs(t, err, idempotency.ErrFenced, "CompleteTx after the lease ran out")
	// Complete outside a transaction still accepts the late owner while no
	// one has taken over: only its own lease is over, and nothing of the
	// outcome is in doubt.
	require.NoError(t, s.Complete(t.Context(), req.Key, owner.Token, okResponse, longRetention))
}

// A completion that rolls back with the business write leaves the record in
// flight, as if the attempt had stalled: its lease runs out, the next claim
// takes over with the same operation ID, and the stale owner is fenced off.
func testCompleteTxRollback(t *testing.T, f *fixture) {
	s, o := f.store(t)
	ctx := t.Context()
	table := charges(t, f, o)
	req := request("pay", time.Second)
	owner := claim(t, s, req)
	require.Equal(t, idempotency.Owner, owner.State)

	tx, err := charge(t, f, s, table, req.Key, owner)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	assert.Zero(t, count(t, f, table), "the business write rolled back")
	retry := req
	retry.OperationID = "op_retry"
	assert.Equal(t, idempotency.InFlight, claim(t, s, retry).State, "the completion rolled back")

	takeover := claimUntil(t, s, retry, idempotency.Owner)
	assert.Equal(t, "op_pay", takeover.OperationID)
	assert.Equal(t, 2, takeover.Attempt)

	tx, err = charge(t, f, s, table, req.Key, owner)
	require.ErrorIs(t, err, idempotency.ErrFenced)
	require.NoError(t, tx.Rollback(ctx))

	tx, err = charge(t, f, s, table, req.Key, takeover)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	assert.Equal(t, 1, count(t, f, table))
	replay := claim(t, s, retry)
	require.Equal(t, idempotency.Completed, replay.State)
	assert.Equal(t, okResponse, replay.Response)
}

// A completion in the caller's transaction is invisible, and wakes no one,
// until the transaction commits; then both writes are visible and waiters
// are woken.
func testCompleteTxCommit(t *testing.T, f *fixture) {
	s, o := f.store(t)
	ctx := t.Context()
	table := charges(t, f, o)
	req := request("pay", longLease)
	owner := claim(t, s, req)
	require.Equal(t, idempotency.Owner, owner.State)

	sub, err := s.Subscribe(ctx, req.Key)
	require.NoError(t, err)
	defer sub.Close()
	waiter := req
	waiter.OperationID, waiter.Watch = "op_waiter", true
	require.Equal(t, idempotency.InFlight, claim(t, s, waiter).State)

	tx, err := charge(t, f, s, table, req.Key, owner)
	require.NoError(t, err)
	reader := req
	reader.OperationID = "op_reader"
	assert.Equal(t, idempotency.InFlight, claim(t, s, reader).State, "completion visible before commit")
	assert.Zero(t, count(t, f, table), "charge visible before commit")
	select {
	case <-sub.C():
		t.Fatal("woken before commit")
	case <-time.After(200 * time.Millisecond): // a notification sent now would have arrived
	}

	require.NoError(t, tx.Commit(ctx))
	requireWoken(t, sub)
	replay := claim(t, s, waiter)
	require.Equal(t, idempotency.Completed, replay.State)
	assert.Equal(t, "op_pay", replay.OperationID)
	assert.Equal(t, okResponse, replay.Response)
	assert.Equal(t, 1, count(t, f, table))
}

func testDeleteExpired(t *testing.T, f *fixture) {
	s, o := f.store(t)
	ctx := t.Context()

	live := []string{"completed", "in_progress", "released"}
	c := claim(t, s, request(live[0], longLease))
	require.NoError(t, s.Complete(ctx, key(live[0]), c.Token, okResponse, longRetention))
	c = claim(t, s, request(live[1], longLease))
	require.Equal(t, idempotency.Owner, c.State)
	c = claim(t, s, request(live[2], longLease))
	require.NoError(t, s.Release(ctx, key(live[2]), c.Token))

	// Expiring in each state: retention runs out on the database's clock.
	// Long enough for the release below to find its record still there.
	brief := func(name string) idempotency.ClaimRequest {
		r := request(name, longLease)
		r.Retention = 250 * time.Millisecond
		return r
	}
	claim(t, s, brief("expired_in_progress"))
	c = claim(t, s, request("expired_completed", longLease))
	require.NoError(t, s.Complete(ctx, key("expired_completed"), c.Token, okResponse, time.Millisecond))
	c = claim(t, s, brief("expired_released"))
	require.NoError(t, s.Release(ctx, key("expired_released"), c.Token))
	// More expired rows than one DeleteExpired statement deletes.
	const bulk = 10005
	_, err := f.pool.Exec(ctx, `INSERT INTO `+o.Table+` (scope, key, fingerprint, state, attempt, operation_id, lease_until, expires_at)
		SELECT 'bulk', 'k' || i, '\x00', 'released', 1, 'op', now(), now() - interval '1 hour' FROM generate_series(1, $1) i`, bulk)
	require.NoError(t, err)
	time.Sleep(2300 * time.Millisecond) // the short retentions run out, and the grace after them

	n, err := s.DeleteExpired(ctx)
	require.NoError(t, err)
	assert.Equal(t, int64(bulk+3), n)
	rows, err := f.pool.Query(ctx, "SELECT key FROM "+o.Table+" ORDER BY key")
	require.NoError(t, err)
	kept, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	assert.Equal(t, live, kept)

	n, err = s.DeleteExpired(ctx)
	require.NoError(t, err)
	assert.Zero(t, n)
}

// waitForLock returns once a statement on table waits for a lock.
func (f *fixture) waitForLock(t *testing.T, table, msg string) {
	t.Helper()
	require.Eventually(t, func() bool {
		var waiting bool
		err := f.pool.QueryRow(t.Context(), `SELECT EXISTS (SELECT FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND strpos(query, $1) > 0)`, table).Scan(&waiting)
		return err == nil && waiting
	}, wakeTimeout, 10*time.Millisecond, msg)
}

// listeners returns the backends that listen on channel.
func listeners(t *testing.T, f *fixture, channel string) []int32 {
	t.Helper()
	rows, err := f.pool.Query(t.Context(), "SELECT pid FROM pg_stat_activity WHERE query = $1",
		"LISTEN "+pgx.Identifier{channel}.Sanitize())
	require.NoError(t, err)
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	require.NoError(t, err)
	return pids
}

// When the listening connection is lost, notifications sent meanwhile are
// lost too: the Store reconnects and wakes every subscriber, then delivers
// notifications again.
func testListenerReconnect(t *testing.T, f *fixture) {
	s, o := f.store(t)
	ctx := t.Context()
	req := request("pay", longLease)
	owner := claim(t, s, req)
	sub, err := s.Subscribe(ctx, req.Key)
	require.NoError(t, err)
	defer sub.Close()
	waiter := req
	waiter.OperationID, waiter.Watch = "op_waiter", true
	require.Equal(t, idempotency.InFlight, claim(t, s, waiter).State)

	before := listeners(t, f, o.Channel)
	require.Len(t, before, 1, "one listening connection per Store")
	var terminated bool
	require.NoError(t, f.pool.QueryRow(ctx, "SELECT pg_terminate_backend($1)", before[0]).Scan(&terminated))
	require.True(t, terminated)

	// Nothing settled the record: only the reconnection wakes the waiter.
	requireWoken(t, sub)
	// The terminated backend may linger in pg_stat_activity a moment.
	require.Eventually(t, func() bool {
		after := listeners(t, f, o.Channel)
		return len(after) == 1 && after[0] != before[0]
	}, wakeTimeout, 20*time.Millisecond, "one new listening connection")

	require.NoError(t, s.Complete(ctx, req.Key, owner.Token, okResponse, longRetention))
	requireWoken(t, sub)
	assert.Equal(t, idempotency.Completed, claim(t, s, waiter).State)

	// Close wakes the remaining subscribers and lets the connection go.
	other := request("other", longLease)
	otherSub, err := s.Subscribe(ctx, other.Key)
	require.NoError(t, err)
	defer otherSub.Close()
	drain(otherSub)
	s.Close()
	requireWoken(t, otherSub)
	require.Eventually(t, func() bool { return len(listeners(t, f, o.Channel)) == 0 }, wakeTimeout, 20*time.Millisecond)
	_, err = s.Subscribe(ctx, other.Key)
	require.ErrorIs(t, err, idempotency.ErrUnavailable)
}

// Many instances may migrate at once, into a schema of the user's choice,
// and again later.
func testMigrateConcurrently(t *testing.T, f *fixture) {
	ctx := t.Context()
	_, err := f.pool.Exec(ctx, "CREATE SCHEMA app")
	require.NoError(t, err)
	o := postgres.Options{Table: "app.records", Channel: "app_wake"}
	migrateConcurrently(t, f, o, 8)
	s := postgres.New(f.pool, o)
	require.NoError(t, s.Migrate(ctx))
	require.Equal(t, idempotency.Owner, claim(t, s, request("k", longLease)).State)
	assert.Equal(t, 1, count(t, f, "app.records"))
}

// Every failure to reach the database is ErrUnavailable, never ErrFenced.
// migrateConcurrently runs Migrate from n Stores at once, as instances
// starting together do, and requires every one to succeed.
func migrateConcurrently(t *testing.T, f *fixture, o postgres.Options, n int) {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range errs {
		wg.Go(func() { errs[i] = postgres.New(f.pool, o).Migrate(t.Context()) })
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
}

func testErrorsAreUnavailable(t *testing.T, f *fixture) {
	ctx := t.Context()
	_, o := f.store(t)
	pool, err := pgxpool.New(ctx, f.pool.Config().ConnString())
	require.NoError(t, err)
	pool.Close()
	s := postgres.New(pool, o)
	defer s.Close()

	_, err = s.Claim(ctx, request("k", longLease))
	require.ErrorIs(t, err, idempotency.ErrUnavailable)
	for name, err := range map[string]error{
		"complete":  s.Complete(ctx, key("k"), 1, okResponse, longRetention),
		"release":   s.Release(ctx, key("k"), 1),
		"forget":    s.Forget(ctx, key("k"), 1),
		"heartbeat": s.Heartbeat(ctx, key("k"), 1, longLease),
		"point":     s.SaveRecoveryPoint(ctx, key("k"), 1, idempotency.RecoveryPoint{Step: "step"}),
		"migrate":   s.Migrate(ctx),
	} {
		require.ErrorIs(t, err, idempotency.ErrUnavailable, name)
		require.NotErrorIs(t, err, idempotency.ErrFenced, name)
	}
	_, err = s.RecoveryPoints(ctx, key("k"), 1)
	require.ErrorIs(t, err, idempotency.ErrUnavailable)
	require.NotErrorIs(t, err, idempotency.ErrFenced)
	_, err = s.DeleteExpired(ctx)
	require.ErrorIs(t, err, idempotency.ErrUnavailable)
	_, err = s.ListAbandoned(ctx, 10)
	require.ErrorIs(t, err, idempotency.ErrUnavailable)
	sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_, err = s.Subscribe(sctx, key("k"))
	require.ErrorIs(t, err, idempotency.ErrUnavailable)
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

//go:embed testdata/schema-v1.sql
var schemaV1 string

// Migrate upgrades a database made by the first schema, whose claim
// function had no o_abandoned (an OUT parameter CREATE OR REPLACE cannot
// add), while instances migrate at once; a record the old function left
// in flight is taken over by the new one, as abandoned.
func testMigrateUpgrade(t *testing.T, f *fixture) {
	ctx := t.Context()
	o := f.options()
	o.Table += ` "o'brien"` // quotes of both kinds, in identifiers and in literals
	require.NoError(t, postgres.New(f.pool, o).MigrateWith(ctx, schemaV1))
	// The old function's claim, with a lease of 0: abandoned at once.
	pay := fp("pay")
	var (
		state string
		token int64
	)
	require.NoError(t, f.pool.QueryRow(ctx, "SELECT o_state, o_token FROM "+pgx.Identifier{o.Table + "_claim"}.Sanitize()+
		"($1, $2, $3, $4, 0, $5, false)", key("pay").Scope, key("pay").Name, pay[:], "op_pay", longRetention.Microseconds()).
		Scan(&state, &token))
	require.Equal(t, "owner", state)

	migrateConcurrently(t, f, o, 4)
	s := postgres.New(f.pool, o)
	t.Cleanup(s.Close)
	require.NoError(t, s.Migrate(ctx), "Migrate on an up-to-date database")

	c := claim(t, s, request("pay", longLease))
	require.Equal(t, idempotency.Owner, c.State)
	assert.Equal(t, 2, c.Attempt)
	assert.Equal(t, "op_pay", c.OperationID)
	assert.True(t, c.Abandoned, "takeover of the record the old function left in flight")
	assert.Greater(t, c.Token, uint64(token))
	require.ErrorIs(t, s.Heartbeat(ctx, key("pay"), uint64(token), longLease), idempotency.ErrFenced)
}

// A claim that read the record abandoned, and then waits for its row while
// the late owner's release commits, takes over a released record: it must
// not report an abandoned one. The conformance suite races the two; here a
// transaction holds the row so that the claim surely waits in between.
func testTakeoverWaitsOutRelease(t *testing.T, f *fixture) {
	s, o := f.store(t)
	ctx := t.Context()
	req := request("pay", longLease)
	owner := claim(t, s, req)
	require.NoError(t, s.Abandon(ctx, req.Key, owner.Token), "giving the lease up")

	tx, err := f.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	where := " WHERE scope = $1 AND key = $2"
	_, err = tx.Exec(ctx, "SELECT FROM "+o.Table+where+" FOR UPDATE", req.Key.Scope, req.Key.Name)
	require.NoError(t, err)

	type result struct {
		c   idempotency.Claim
		err error
	}
	claimed := make(chan result, 1)
	retry := req
	retry.OperationID = "op_retry"
	go func() {
		c, err := s.Claim(ctx, retry)
		claimed <- result{c, err}
	}()
	f.waitForLock(t, o.Table, "the claim never waited for the row")

	// Store.Release's statement, in the transaction that holds the row.
	tag, err := tx.Exec(ctx, "UPDATE "+o.Table+" SET state = 'released'"+where+" AND token = $3",
		req.Key.Scope, req.Key.Name, int64(owner.Token))
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())
	require.NoError(t, tx.Commit(ctx))

	var r result
	select {
	case r = <-claimed:
	case <-time.After(wakeTimeout):
		t.Fatalf("the claim did not return within %v of the release", wakeTimeout)
	}
	require.NoError(t, r.err)
	require.Equal(t, idempotency.Owner, r.c.State)
	assert.Equal(t, 2, r.c.Attempt)
	assert.Equal(t, "op_pay", r.c.OperationID)
	assert.False(t, r.c.Abandoned, "takeover of a record released while the claim waited")
}

// A row whose fingerprint is not a SHA-256 fails Abandoned with
// ErrUnavailable rather than yield a record no claim can match.
func testAbandonedCorruptFingerprint(t *testing.T, f *fixture) {
	s, o := f.store(t)
	ctx := t.Context()
	_, err := f.pool.Exec(ctx, `INSERT INTO `+o.Table+` (scope, key, fingerprint, state, attempt, operation_id, lease_until, expires_at)
		VALUES ('acct_1', 'short', '\x00', 'in_progress', 1, 'op', now(), now() + interval '1 hour')`)
	require.NoError(t, err)
	_, err = s.ListAbandoned(ctx, 10)
	require.ErrorIs(t, err, idempotency.ErrUnavailable)
}
