package postgres_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The environment of the child process of OneCommitKilled.
const (
	childDSN   = "IDEMPOTENCY_ONECOMMIT_CHILD_DSN"
	childTable = "IDEMPOTENCY_ONECOMMIT_CHILD_TABLE"
)

// TestOneCommit runs the one-commit mode's cases against one PostgreSQL
// server; each case has tables of its own.
func TestOneCommit(t *testing.T) {
	pg := testserver.StartPostgres(t)
	f := &fixture{pool: ocPool(t, pg.DSN)}
	cases := []struct {
		name string
		run  func(*testing.T, *fixture, string)
	}{
		{"NewAndReplay", testOneCommitNewAndReplay},
		{"ErrorLeavesNothing", testOneCommitErrorLeavesNothing},
		{"Killed", testOneCommitKilled},
		{"ConcurrentDuplicates", testOneCommitConcurrentDuplicates},
		{"WaitBound", testOneCommitWaitBound},
		{"StalledOwner", testOneCommitStalledOwner},
		{"Mismatch", testOneCommitMismatch},
		{"BothKinds", testOneCommitBothKinds},
		{"Middleware", testOneCommitMiddleware},
		{"OwnerlessInfo", testOneCommitOwnerlessInfo},
		{"ExpiredRecordMadeAnew", testOneCommitExpiredRecordMadeAnew},
		{"TxEndsWithRecord", testOneCommitTxEndsWithRecord},
		{"ReplayStorm", testOneCommitReplayStorm},
		{"Run", testOneCommitRun},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { c.run(t, f, pg.DSN) })
	}
}

// onePool is a pool of its own on dsn, with room for every caller of a race.
func ocPool(t *testing.T, dsn string) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(dsn)
	require.NoError(t, err)
	cfg.MaxConns = claimers + 10
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// chargeOp is an operation that records a charge in its transaction and
// answers with its operation ID, counting its runs.
func chargeOp(table string, runs *atomic.Int64) func(ctx context.Context) (idempotency.Response, error) {
	return func(ctx context.Context) (idempotency.Response, error) {
		runs.Add(1)
		info, _ := idempotency.FromContext(ctx)
		tx, ok := postgres.TxFromContext(ctx)
		if !ok {
			return idempotency.Response{}, errors.New("no transaction in the operation's context")
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+table+" (operation_id, amount) VALUES ($1, 100)", info.OperationID); err != nil {
			return idempotency.Response{}, err
		}
		return idempotency.Response{Status: http.StatusCreated, Body: []byte(info.OperationID)}, nil
	}
}

// records counts the live records of the store's table.
func records(t *testing.T, f *fixture, o postgres.Options) int {
	t.Helper()
	var n int
	require.NoError(t, f.pool.QueryRow(t.Context(), "SELECT count(*) FROM "+o.Table+" WHERE expires_at > now()").Scan(&n))
	return n
}

// A new operation commits its business write and its record together; the
// retry replays it without running it.
func testOneCommitNewAndReplay(t *testing.T, f *fixture, _ string) {
	s, o := f.store(t)
	table := charges(t, f, o)
	g := idempotency.New(s.OneCommit(), idempotency.Options{Retention: longRetention})
	var runs atomic.Int64
	first, err := g.Do(t.Context(), key("new"), fp("new"), chargeOp(table, &runs))
	require.NoError(t, err)
	assert.False(t, first.Replayed)
	assert.Equal(t, first.OperationID, string(first.Response.Body))
	again, err := g.Do(t.Context(), key("new"), fp("new"), chargeOp(table, &runs))
	require.NoError(t, err)
	assert.True(t, again.Replayed)
	assert.Equal(t, first.Response.Body, again.Response.Body)
	assert.Equal(t, first.OperationID, again.OperationID)
	assert.Equal(t, int64(1), runs.Load())
	assert.Equal(t, 1, count(t, f, table))
	rec, err := s.Inspect(t.Context(), key("new"))
	require.NoError(t, err)
	assert.Equal(t, idempotency.RecordCompleted, rec.State)
	assert.Equal(t, http.StatusCreated, rec.Status)
	assert.Greater(t, rec.ExpiresIn, 50*time.Minute, "kept for the retention")
}

// An operation that fails leaves neither its record nor its business write;
// its retry runs it once.
func testOneCommitErrorLeavesNothing(t *testing.T, f *fixture, _ string) {
	s, o := f.store(t)
	table := charges(t, f, o)
	g := idempotency.New(s.OneCommit(), idempotency.Options{Retention: longRetention})
	var runs atomic.Int64
	failure := errors.New("the operation failed")
	_, err := g.Do(t.Context(), key("fail"), fp("fail"), func(ctx context.Context) (idempotency.Response, error) {
		_, _ = chargeOp(table, &runs)(ctx)
		return idempotency.Response{}, failure
	})
	require.ErrorIs(t, err, failure)
	assert.NotErrorIs(t, err, idempotency.ErrUnavailable)
	assert.Equal(t, 0, count(t, f, table))
	assert.Equal(t, 0, records(t, f, o))

	assert.Panics(t, func() {
		_, _ = g.Do(t.Context(), key("fail"), fp("fail"), func(ctx context.Context) (idempotency.Response, error) {
			_, _ = chargeOp(table, &runs)(ctx)
			panic("the operation panicked")
		})
	})
	assert.Equal(t, 0, count(t, f, table))
	assert.Equal(t, 0, records(t, f, o), "a panic leaves nothing")

	res, err := g.Do(t.Context(), key("fail"), fp("fail"), chargeOp(table, &runs))
	require.NoError(t, err)
	assert.False(t, res.Replayed)
	assert.Equal(t, int64(3), runs.Load())
	assert.Equal(t, 1, count(t, f, table))
}

// An owner killed (SIGKILL) in the middle of its transaction, its business
// write made, leaves nothing: the retry runs the operation once, and the
// business row exists once.
func testOneCommitKilled(t *testing.T, f *fixture, dsn string) {
	s, o := f.store(t)
	table := charges(t, f, o)
	cmd := exec.Command(os.Args[0], "-test.run=^TestOneCommitChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), childDSN+"="+dsn, childTable+"="+o.Table)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	lines := bufio.NewScanner(out)
	for lines.Scan() && lines.Text() != "charged" {
	}
	require.Equal(t, "charged", lines.Text(), "the child's operation made its business write")
	require.NoError(t, cmd.Process.Signal(os.Kill))
	_ = cmd.Wait()

	g := idempotency.New(s.OneCommit(), idempotency.Options{Retention: longRetention})
	var runs atomic.Int64
	res, err := g.Do(t.Context(), key("killed"), fp("killed"), chargeOp(table, &runs))
	require.NoError(t, err)
	assert.False(t, res.Replayed)
	assert.Equal(t, int64(1), runs.Load())
	assert.Equal(t, 1, count(t, f, table))
	var charged string
	require.NoError(t, f.pool.QueryRow(t.Context(), "SELECT operation_id FROM "+table).Scan(&charged))
	assert.Equal(t, res.OperationID, charged, "the row is the retry's")
}

// TestOneCommitChild is the owner that testOneCommitKilled kills: it makes
// its business write in a one-commit operation, says so, and blocks.
func TestOneCommitChild(t *testing.T) {
	dsn := os.Getenv(childDSN)
	if dsn == "" {
		t.Skip("run by TestOneCommit/Killed")
	}
	pool, err := pgxpool.New(context.Background(), dsn)
	require.NoError(t, err)
	o := postgres.Options{Table: os.Getenv(childTable), Channel: "wake_child"}
	g := idempotency.New(postgres.New(pool, o).OneCommit(), idempotency.Options{Retention: longRetention, Lease: time.Hour})
	var runs atomic.Int64
	_, _ = g.Do(context.Background(), key("killed"), fp("killed"), func(ctx context.Context) (idempotency.Response, error) {
		if _, err := chargeOp("charges_"+o.Table, &runs)(ctx); err != nil {
			return idempotency.Response{}, err
		}
		fmt.Println("charged")
		select {} // until killed
	})
}

// Concurrent duplicates through two stores on pools of their own: the
// operation runs once, and every caller gets its answer.
func testOneCommitConcurrentDuplicates(t *testing.T, f *fixture, dsn string) {
	s, o := f.store(t)
	table := charges(t, f, o)
	other := postgres.New(ocPool(t, dsn), o)
	t.Cleanup(other.Close)
	guards := []*idempotency.Guard{
		idempotency.New(s.OneCommit(), idempotency.Options{Retention: longRetention}),
		idempotency.New(other.OneCommit(), idempotency.Options{Retention: longRetention}),
	}
	var runs atomic.Int64
	op := chargeOp(table, &runs)
	slow := func(ctx context.Context) (idempotency.Response, error) {
		time.Sleep(50 * time.Millisecond) // the others queue on the row meanwhile
		return op(ctx)
	}
	results := make([]idempotency.Result, 20)
	errs := make([]error, len(results))
	var wg sync.WaitGroup
	for i := range results {
		wg.Go(func() {
			results[i], errs[i] = guards[i%2].Do(context.Background(), key("dup"), fp("dup"), slow)
		})
	}
	wg.Wait()
	assert.Equal(t, int64(1), runs.Load())
	assert.Equal(t, 1, count(t, f, table))
	replayed := 0
	for i, res := range results {
		require.NoError(t, errs[i], "caller %d", i)
		assert.Equal(t, results[0].Response.Body, res.Response.Body, "caller %d", i)
		if res.Replayed {
			replayed++
		}
	}
	assert.Equal(t, len(results)-1, replayed)
}

// hold runs a one-commit operation on k in the background that holds its
// transaction open until release is closed, once its claim is made.
func hold(t *testing.T, oc *postgres.OneCommit, k idempotency.Key, lease time.Duration, release <-chan struct{}) <-chan error {
	held, done := make(chan struct{}), make(chan error, 1)
	g := idempotency.New(oc, idempotency.Options{Retention: longRetention, Lease: lease})
	go func() {
		_, err := g.Do(context.Background(), k, fp(k.Name), func(ctx context.Context) (idempotency.Response, error) {
			close(held)
			<-release
			return idempotency.Response{Status: http.StatusOK, Body: []byte("held")}, nil
		})
		done <- err
	}()
	select {
	case <-held:
	case err := <-done:
		t.Fatalf("the holder ended before its operation ran: %v", err)
	}
	return done
}

// A duplicate waits for the owner's transaction at most its WaitTimeout,
// then fails with ErrInFlight; one that waits longer gets the answer.
func testOneCommitWaitBound(t *testing.T, f *fixture, _ string) {
	s, _ := f.store(t)
	oc := s.OneCommit()
	release := make(chan struct{})
	done := hold(t, oc, key("wait"), longLease, release)

	const bound = 300 * time.Millisecond
	short := idempotency.New(oc, idempotency.Options{Retention: longRetention, WaitTimeout: bound})
	var runs atomic.Int64
	start := time.Now()
	_, err := short.Do(t.Context(), key("wait"), fp("wait"), func(context.Context) (idempotency.Response, error) {
		runs.Add(1)
		return idempotency.Response{}, nil
	})
	require.ErrorIs(t, err, idempotency.ErrInFlight)
	assert.GreaterOrEqual(t, time.Since(start), bound, "it waited out its bound")
	noWait := idempotency.New(oc, idempotency.Options{Retention: longRetention, WaitTimeout: -1})
	_, err = noWait.Do(t.Context(), key("wait"), fp("wait"), func(context.Context) (idempotency.Response, error) {
		runs.Add(1)
		return idempotency.Response{}, nil
	})
	require.ErrorIs(t, err, idempotency.ErrInFlight)

	long := idempotency.New(oc, idempotency.Options{Retention: longRetention, WaitTimeout: time.Minute})
	answer := make(chan idempotency.Result, 1)
	go func() {
		res, err := long.Do(context.Background(), key("wait"), fp("wait"), func(context.Context) (idempotency.Response, error) {
			runs.Add(1)
			return idempotency.Response{}, nil
		})
		assert.NoError(t, err)
		answer <- res
	}()
	time.Sleep(100 * time.Millisecond) // let it queue on the row
	close(release)
	require.NoError(t, <-done)
	res := <-answer
	assert.True(t, res.Replayed)
	assert.Equal(t, "held", string(res.Response.Body))
	assert.Equal(t, int64(0), runs.Load())
}

// An owner that stalls in its transaction past the lease has it ended by
// the server: the duplicate then runs the operation, and the old owner's
// commit fails, storing nothing.
func testOneCommitStalledOwner(t *testing.T, f *fixture, _ string) {
	s, o := f.store(t)
	table := charges(t, f, o)
	oc := s.OneCommit()
	g := idempotency.New(oc, idempotency.Options{Retention: longRetention, Lease: 300 * time.Millisecond})
	var runs atomic.Int64
	op := chargeOp(table, &runs)
	charged, stalled := make(chan struct{}), make(chan error, 1)
	go func() {
		_, err := g.Do(context.Background(), key("stall"), fp("stall"), func(ctx context.Context) (idempotency.Response, error) {
			resp, err := op(ctx)
			close(charged)
			time.Sleep(2 * time.Second) // idle in transaction, past the lease
			return resp, err
		})
		stalled <- err
	}()
	<-charged
	dup := idempotency.New(oc, idempotency.Options{Retention: longRetention, WaitTimeout: time.Minute})
	res, err := dup.Do(t.Context(), key("stall"), fp("stall"), op)
	require.NoError(t, err)
	assert.False(t, res.Replayed, "the duplicate ran the operation")
	err = <-stalled
	require.ErrorIs(t, err, idempotency.ErrUnavailable, "the stalled owner's commit fails")
	assert.Equal(t, int64(2), runs.Load())
	assert.Equal(t, 1, count(t, f, table))
	again, err := dup.Do(t.Context(), key("stall"), fp("stall"), op)
	require.NoError(t, err)
	assert.True(t, again.Replayed)
	assert.Equal(t, res.Response.Body, again.Response.Body, "the duplicate's outcome is the one stored")
}

// A key's record answers another request with ErrMismatch, and the
// middleware with 422.
func testOneCommitMismatch(t *testing.T, f *fixture, _ string) {
	s, o := f.store(t)
	table := charges(t, f, o)
	g := idempotency.New(s.OneCommit(), idempotency.Options{Retention: longRetention})
	var runs atomic.Int64
	_, err := g.Do(t.Context(), key("fp"), fp("one request"), chargeOp(table, &runs))
	require.NoError(t, err)
	_, err = g.Do(t.Context(), key("fp"), fp("another request"), chargeOp(table, &runs))
	require.ErrorIs(t, err, idempotency.ErrMismatch)
	assert.Equal(t, int64(1), runs.Load())

	h := g.Middleware(idempotency.MiddlewareOptions{Scope: byAccount})(oneCommitHandler(table, &runs))
	first := post(t, h, "acct_1", "k")
	require.Equal(t, http.StatusCreated, first.status, first.body)
	r := httptestPost("acct_1", "k", `{"amount":200}`)
	w := serve(h, r)
	assert.Equal(t, http.StatusUnprocessableEntity, w.status, w.body)
}

// A table holding records of both modes: Stats, ListInFlight and Inspect
// see the lease mode's records in flight only, never a one-commit
// transaction's, and the one-commit mode leaves a record of the lease mode
// in flight alone (ErrInFlight).
func testOneCommitBothKinds(t *testing.T, f *fixture, _ string) {
	s, _ := f.store(t)
	oc := s.OneCommit()
	leased := claim(t, s, request("leased", longLease))
	require.Equal(t, idempotency.Owner, leased.State)
	release := make(chan struct{})
	done := hold(t, oc, key("held"), longLease, release)
	g := idempotency.New(oc, idempotency.Options{Retention: longRetention, WaitTimeout: -1})
	_, err := g.Do(t.Context(), key("done"), fp("done"), func(context.Context) (idempotency.Response, error) {
		return idempotency.Response{Status: http.StatusOK, Body: []byte("done")}, nil
	})
	require.NoError(t, err)

	st, err := oc.Stats(t.Context())
	require.NoError(t, err)
	assert.Equal(t, idempotency.Stats{InFlight: 1}, st)
	list, _, err := oc.ListInFlight(t.Context(), "", 10)
	require.NoError(t, err)
	require.Len(t, list, 1)
	assert.Equal(t, key("leased"), list[0].Key)
	rec, err := oc.Inspect(t.Context(), key("done"))
	require.NoError(t, err)
	assert.Equal(t, idempotency.RecordCompleted, rec.State)
	_, err = oc.Inspect(t.Context(), key("held"))
	require.ErrorIs(t, err, idempotency.ErrNoRecord, "nobody sees a record in flight in the one-commit mode")

	_, err = g.Do(t.Context(), key("leased"), fp("leased"),
		func(context.Context) (idempotency.Response, error) { return idempotency.Response{}, nil })
	require.ErrorIs(t, err, idempotency.ErrInFlight, "a record of the lease mode in flight")
	close(release)
	require.NoError(t, <-done)
	rec, err = oc.Inspect(t.Context(), key("held"))
	require.NoError(t, err)
	assert.Equal(t, idempotency.RecordCompleted, rec.State)
	require.NoError(t, s.Complete(t.Context(), key("leased"), leased.Token, idempotency.Response{Status: 200}, longRetention))
	st, err = oc.Stats(t.Context())
	require.NoError(t, err)
	assert.Equal(t, idempotency.Stats{}, st)
}

// oneCommitHandler records a charge in the request's one-commit
// transaction and answers 201, or, for an amount of 0, writes the charge
// and answers 500, which rolls it back.
func oneCommitHandler(table string, runs *atomic.Int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		info, _ := idempotency.FromContext(r.Context())
		tx, ok := postgres.TxFromContext(r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		if _, err := tx.Exec(r.Context(), "INSERT INTO "+table+" (operation_id, amount) VALUES ($1, 100)", info.OperationID); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if r.Header.Get("X-Fail") != "" {
			http.Error(w, "failed after the write", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"charge":%q}`, info.OperationID)
	})
}

func httptestPost(account, k, body string) *http.Request {
	r, _ := http.NewRequest(http.MethodPost, "http://example.com/charges", strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("X-Account", account)
	r.Header.Set(idempotency.HeaderKey, k)
	return r
}

// recorded is the answer of a handler that served a request.
type recorded struct {
	status int
	header http.Header
	body   string
}

func serve(h http.Handler, r *http.Request) recorded {
	w := &bufWriter{header: http.Header{}}
	h.ServeHTTP(w, r)
	return recorded{w.status, w.header, w.body.String()}
}

// bufWriter is a minimal http.ResponseWriter.
type bufWriter struct {
	header http.Header
	status int
	body   strings.Builder
}

func (w *bufWriter) Header() http.Header { return w.header }
func (w *bufWriter) WriteHeader(status int) {
	if w.status == 0 {
		w.status = status
	}
}
func (w *bufWriter) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return w.body.Write(p)
}

// The middleware over the one-commit mode: the handler's business write
// and the response commit together; a replay sends the stored response; a
// 5xx rolls the write back and the retry runs the handler again.
func testOneCommitMiddleware(t *testing.T, f *fixture, _ string) {
	s, o := f.store(t)
	table := charges(t, f, o)
	g := idempotency.New(s.OneCommit(), idempotency.Options{Retention: longRetention})
	var runs atomic.Int64
	h := g.Middleware(idempotency.MiddlewareOptions{Scope: byAccount})(oneCommitHandler(table, &runs))

	first := post(t, h, "acct_1", "m1")
	assert.Equal(t, http.StatusCreated, first.status, first.body)
	assert.Empty(t, first.replayed)
	again := post(t, h, "acct_1", "m1")
	assert.Equal(t, answer{http.StatusCreated, "true", first.body}, again)
	assert.Equal(t, int64(1), runs.Load())
	assert.Equal(t, 1, count(t, f, table))

	r := httptestPost("acct_1", "m2", `{"amount":100}`)
	r.Header.Set("X-Fail", "1")
	failed := serve(h, r)
	assert.Equal(t, http.StatusInternalServerError, failed.status, failed.body)
	assert.Equal(t, 1, count(t, f, table), "the failed request's write rolled back")
	retry := post(t, h, "acct_1", "m2")
	assert.Equal(t, http.StatusCreated, retry.status, retry.body)
	assert.Empty(t, retry.replayed)
	assert.Equal(t, int64(3), runs.Load())
	assert.Equal(t, 2, count(t, f, table))

	big := idempotency.New(s.OneCommit(), idempotency.Options{Retention: longRetention})
	hb := big.Middleware(idempotency.MiddlewareOptions{Scope: byAccount, MaxResponseBytes: 4})(oneCommitHandler(table, &runs))
	tooLarge := post(t, hb, "acct_1", "m3")
	assert.Equal(t, http.StatusServiceUnavailable, tooLarge.status, "a response over MaxResponseBytes cannot stream before the commit")
	assert.Equal(t, 2, count(t, f, table), "and its write rolled back")
}

// Inside a one-commit operation a step is a plain call, and what needs a
// lease fails without a panic.
func testOneCommitOwnerlessInfo(t *testing.T, f *fixture, _ string) {
	s, _ := f.store(t)
	g := idempotency.New(s.OneCommit(), idempotency.Options{Retention: longRetention})
	_, err := g.Do(t.Context(), key("info"), fp("info"), func(ctx context.Context) (idempotency.Response, error) {
		steps := 0
		for range 2 {
			v, err := idempotency.Step(ctx, "charge", func(context.Context) (int, error) { steps++; return steps, nil })
			require.NoError(t, err)
			assert.Equal(t, steps, v)
		}
		assert.Equal(t, 2, steps, "nothing recorded: every call runs")
		info, _ := idempotency.FromContext(ctx)
		_, err := info.RecoveryPoints(ctx)
		assert.ErrorIs(t, err, idempotency.ErrNoRecoveryPoints)
		tx, _ := postgres.TxFromContext(ctx)
		assert.Error(t, s.CompleteTx(ctx, tx, idempotency.Response{Status: 200}))
		_, err = idempotency.Step(ctx, "outside", func(ctx context.Context) (int, error) { return 0, s.StepTx(ctx, tx, 1) })
		assert.Error(t, err)
		assert.Equal(t, 1, info.Attempt)
		assert.NotZero(t, info.Token)
		return idempotency.Response{Status: http.StatusOK}, nil
	})
	require.NoError(t, err)
}

// A record past its retention that DeleteExpired has not deleted yet counts
// as absent: the next request, of any fingerprint, makes it anew, with a
// greater token.
func testOneCommitExpiredRecordMadeAnew(t *testing.T, f *fixture, _ string) {
	s, o := f.store(t)
	oc := s.OneCommit()
	req := request("expired", longLease)
	first := expired(t, oc, req)
	req.Fingerprint, req.OperationID = fp("another"), "op_another"
	again, err := oc.Transact(t.Context(), req, time.Second, keep)
	require.NoError(t, err)
	require.Equal(t, idempotency.Owner, again.State)
	assert.Greater(t, again.Token, first.Token)
	assert.Equal(t, 1, records(t, f, o))
	replay, err := oc.Transact(t.Context(), req, time.Second, keep)
	require.NoError(t, err)
	assert.Equal(t, idempotency.Completed, replay.State)
	assert.Equal(t, "op_another", replay.OperationID)
}

// keep is a one-commit operation that answers 200, kept.
func keep(context.Context, idempotency.Claim) (idempotency.Response, bool, error) {
	return idempotency.Response{Status: http.StatusOK}, true, nil
}

// expired makes the record of req kept for a millisecond, waits until it
// has expired, and returns its claim.
func expired(t *testing.T, oc *postgres.OneCommit, req idempotency.ClaimRequest) idempotency.Claim {
	t.Helper()
	req.Retention = time.Millisecond
	c, err := oc.Transact(t.Context(), req, time.Second, keep)
	require.NoError(t, err)
	require.Equal(t, idempotency.Owner, c.State)
	time.Sleep(20 * time.Millisecond)
	return c
}

// Run, a queue consumer's entry, reaches the mode as Do does: the value is
// computed in the transaction with the business write, stored with it, and
// every later call decodes the same value without running the operation.
func testOneCommitRun(t *testing.T, f *fixture, _ string) {
	s, o := f.store(t)
	table := charges(t, f, o)
	g := idempotency.New(s.OneCommit(), idempotency.Options{Retention: longRetention})
	type charge struct {
		ID     string
		Amount int
	}
	var runs atomic.Int64
	consume := func(ctx context.Context) (charge, error) {
		resp, err := chargeOp(table, &runs)(ctx)
		return charge{ID: string(resp.Body), Amount: 100}, err
	}
	first, replayed, err := idempotency.Run(t.Context(), g, key("msg"), fp("msg"), consume)
	require.NoError(t, err)
	assert.False(t, replayed)
	assert.NotEmpty(t, first.ID)
	again, replayed, err := idempotency.Run(t.Context(), g, key("msg"), fp("msg"), consume)
	require.NoError(t, err)
	assert.True(t, replayed)
	assert.Equal(t, first, again)
	assert.Equal(t, int64(1), runs.Load())
	var charged string
	require.NoError(t, f.pool.QueryRow(t.Context(), "SELECT operation_id FROM "+table).Scan(&charged))
	assert.Equal(t, first.ID, charged, "the business row is the stored value's")
}

// While most claims are answered from a committed record (a retry storm),
// a replay reads that record before it claims: it answers as the claim
// would, but waits for no transaction writing the row, which a claim's
// insert waits for. Every other outcome is still the claim's: a new key
// runs once, a key in flight is waited for, an expired record is made anew.
func testOneCommitReplayStorm(t *testing.T, f *fixture, _ string) {
	s, o := f.store(t)
	table := charges(t, f, o)
	oc := s.OneCommit()
	g := idempotency.New(oc, idempotency.Options{Retention: longRetention, WaitTimeout: 300 * time.Millisecond})
	var runs atomic.Int64
	op := chargeOp(table, &runs)
	first, err := g.Do(t.Context(), key("storm"), fp("storm"), op)
	require.NoError(t, err)
	writer, err := f.pool.Begin(t.Context())
	require.NoError(t, err)
	defer func() { _ = writer.Rollback(context.Background()) }()
	_, err = writer.Exec(t.Context(), "UPDATE "+o.Table+" SET expires_at = expires_at WHERE scope = $1 AND key = $2", key("storm").Scope, key("storm").Name)
	require.NoError(t, err)
	_, err = g.Do(t.Context(), key("storm"), fp("storm"), op)
	require.ErrorIs(t, err, idempotency.ErrInFlight, "outside a storm, a replay claims, and waits for the row's writer")

	_, err = g.Do(t.Context(), key("other"), fp("other"), op)
	require.NoError(t, err)
	for range 30 {
		res, err := g.Do(t.Context(), key("other"), fp("other"), op)
		require.NoError(t, err)
		require.True(t, res.Replayed)
	}
	start := time.Now()
	res, err := g.Do(t.Context(), key("storm"), fp("storm"), op)
	require.NoError(t, err, "in a storm, a replay reads the committed record")
	assert.Less(t, time.Since(start), 300*time.Millisecond, "and waits for no writer")
	assert.True(t, res.Replayed)
	assert.Equal(t, first.Response.Body, res.Response.Body)
	assert.Equal(t, first.OperationID, res.OperationID)
	_, err = g.Do(t.Context(), key("storm"), fp("another request"), op)
	require.ErrorIs(t, err, idempotency.ErrMismatch)
	require.NoError(t, writer.Rollback(t.Context()))

	res, err = g.Do(t.Context(), key("new"), fp("new"), op)
	require.NoError(t, err)
	assert.False(t, res.Replayed, "a new key in a storm is claimed and run")
	release := make(chan struct{})
	done := hold(t, oc, key("flight"), longLease, release)
	waited := make(chan idempotency.Result, 1)
	go func() {
		long := idempotency.New(oc, idempotency.Options{Retention: longRetention, WaitTimeout: time.Minute})
		res, err := long.Do(context.Background(), key("flight"), fp("flight"), op)
		assert.NoError(t, err)
		waited <- res
	}()
	time.Sleep(100 * time.Millisecond) // let it queue on the row
	close(release)
	require.NoError(t, <-done)
	res = <-waited
	assert.True(t, res.Replayed, "a key in flight is waited for")
	assert.Equal(t, "held", string(res.Response.Body))

	req := request("expired", longLease)
	expired(t, oc, req)
	c, err := oc.Transact(t.Context(), req, time.Second, keep)
	require.NoError(t, err)
	assert.Equal(t, idempotency.Owner, c.State, "an expired record is made anew")
	assert.Equal(t, int64(3), runs.Load(), "storm, other, new")
	assert.Equal(t, 3, count(t, f, table))
}

// The operation cannot end its transaction apart from its record: its
// Commit and Rollback fail and change nothing, while a savepoint it makes
// commits or rolls back as in any pgx.Tx.
func testOneCommitTxEndsWithRecord(t *testing.T, f *fixture, _ string) {
	s, o := f.store(t)
	table := charges(t, f, o)
	g := idempotency.New(s.OneCommit(), idempotency.Options{Retention: longRetention})
	res, err := g.Do(t.Context(), key("ended"), fp("ended"), func(ctx context.Context) (idempotency.Response, error) {
		tx, _ := postgres.TxFromContext(ctx)
		if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ('kept', 1)"); err != nil {
			return idempotency.Response{}, err
		}
		if err := tx.Commit(ctx); err == nil {
			return idempotency.Response{}, errors.New("the operation committed its transaction")
		}
		if err := tx.Rollback(ctx); err == nil {
			return idempotency.Response{}, errors.New("the operation rolled its transaction back")
		}
		for _, commit := range []bool{false, true} {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return idempotency.Response{}, err
			}
			if _, err := sp.Exec(ctx, "INSERT INTO "+table+" VALUES ($1, 2)", fmt.Sprint("savepoint-", commit)); err != nil {
				return idempotency.Response{}, err
			}
			end := sp.Rollback
			if commit {
				end = sp.Commit
			}
			if err := end(ctx); err != nil {
				return idempotency.Response{}, err
			}
		}
		return idempotency.Response{Status: http.StatusCreated}, nil
	})
	require.NoError(t, err)
	assert.Equal(t, http.StatusCreated, res.Response.Status)
	rows, err := f.pool.Query(t.Context(), "SELECT operation_id FROM "+table+" ORDER BY operation_id")
	require.NoError(t, err)
	var ids []string
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		ids = append(ids, id)
	}
	require.NoError(t, rows.Err())
	assert.Equal(t, []string{"kept", "savepoint-true"}, ids)
	assert.Equal(t, 1, records(t, f, o))
}
