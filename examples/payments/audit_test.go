package main

// The kill audit: instances that SIGKILL themselves between two steps of a
// charge, over and over, while clients retry many charges to the end; then
// a count, from the services' own rows, of how often each step ran.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/report"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

const (
	// auditOpsEnv sets the charges per crash point (default 24).
	auditOpsEnv       = "PAYMENTS_AUDIT_OPS"
	auditInstances    = 3
	auditClients      = 8
	auditCrashEvery   = "3"
	auditAttemptLimit = 15 * time.Second // a client's timeout: a retry may wait out a lease
	auditKeyDeadline  = 90 * time.Second // a charge without a 201 by then is a failure
)

// steps are a charge's steps, in order; each is also a crash point.
var steps = []string{"order", "charge", "receipt"}

// TestKillAudit checks that recovery points make a charge resume rather than
// repeat. On each store, for each crash point (right after the order,
// after the charge, after the receipt and before completion), it runs
// charges on instances that kill themselves with SIGKILL right after every
// third run of that step by a charge's first attempt (the kill also ends the
// other charges in flight there, wherever they are), restarts each killed
// instance, and retries every charge until it is answered 201. Each step's service keeps a row per run
// that nothing de-duplicates (the orders, the gateway's calls, the
// receipts), so the audit counts what ran: with recovery points every step
// of every charge ran exactly once, and every retry of a charge replays its
// first 201. The same run with -recovery-points=false must repeat steps,
// which shows that the audit can fail. It logs a table per store and mode.
//
// A bigger run, with 200 charges per crash point:
//
//	IDEMPOTENCY_REQUIRE_SERVERS=1 PAYMENTS_AUDIT_OPS=200 go test -count=1 -run TestKillAudit -v ./examples/payments
func TestKillAudit(t *testing.T) {
	t.Parallel()
	ops := 24
	if v := os.Getenv(auditOpsEnv); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(t, err, auditOpsEnv)
		ops = n
	}
	for _, store := range []string{"redis", "postgres"} {
		t.Run(store, func(t *testing.T) {
			t.Parallel()
			a := newAudit(t, store, ops)
			on, off := a.run(t, true), a.run(t, false)
			t.Logf("with recovery points:\n%s", on.format(store))
			t.Logf("without recovery points (every attempt runs every step):\n%s", off.format(store))
			for _, row := range on {
				assert.Zero(t, row.repeated, "%s: steps repeated with recovery points", row.point)
			}
			assert.NotZero(t, off.total().repeated, "no step repeated without recovery points: the audit cannot fail")
			report.Add(t, report.Entry{Suite: "kill-audit", Store: store, Faults: map[string]int{"kill": on.total().kills},
				Operations: on.total().ops, DoubleExecutions: on.total().repeated,
				Notes: fmt.Sprintf("without recovery points, %d steps repeated", off.total().repeated)})
		})
	}
}

// audit is the runs of the kill audit on one store.
type audit struct {
	store string
	ops   int
	flags []string                    // an instance's flags to reach the store
	runs  func(*testing.T) executions // reads every step's rows from the store
}

func newAudit(t *testing.T, store string, ops int) *audit {
	a := &audit{store: store, ops: ops}
	if store == "redis" {
		rs := testserver.StartRedis(t)
		a.flags, a.runs = []string{"-redis", rs.Addr}, func(t *testing.T) executions { return redisExecutions(t, rs.Client()) }
		return a
	}
	pg := testserver.StartPostgres(t)
	pool, err := pgxpool.New(t.Context(), pg.DSN)
	require.NoError(t, err)
	defer pool.Close()
	_, err = newPostgresBackend(t.Context(), pool, nil, 0) // the tables, read before an instance makes them
	require.NoError(t, err)
	a.flags, a.runs = []string{"-postgres", pg.DSN}, func(t *testing.T) executions { return postgresExecutions(t, pg.DSN) }
	return a
}

// run runs the audit for every crash point, with or without recovery
// points, and checks every charge's answers.
func (a *audit) run(t *testing.T, resume bool) auditTable {
	var table auditTable
	for _, point := range steps {
		before := a.runs(t)
		args := append([]string{"-lease", "1s", "-wait", "5s", "-crash-after", point, "-crash-every", auditCrashEvery,
			"-recovery-points=" + strconv.FormatBool(resume)}, a.flags...)
		f := newFleet(t, args)
		answers := f.charge(t, fmt.Sprintf("%s-%t-%s", a.store, resume, point), a.ops)
		f.requireReplays(t, answers)
		f.stop()
		row := a.runs(t).since(before).row(t, point, a.ops)
		row.kills = f.kills
		assert.NotZero(t, row.kills, "after %s: no instance was killed", point)
		table = append(table, row)
	}
	return table
}

// fleet is a service of instances that may kill themselves: whenever one
// dies, another takes its place.
type fleet struct {
	args  []string
	mu    sync.Mutex
	procs []*instance
	exits chan int // the index of an instance that exited
	kills int
}

func newFleet(t *testing.T, args []string) *fleet {
	f := &fleet{args: args, procs: make([]*instance, auditInstances), exits: make(chan int, auditInstances)}
	for i := range f.procs {
		f.start(t, i)
	}
	return f
}

// start starts instance i, in place of the one before, if any.
func (f *fleet) start(t *testing.T, i int) {
	in := start(t, f.args...)
	f.mu.Lock()
	f.procs[i] = in
	f.mu.Unlock()
	go func() {
		<-in.exited
		f.exits <- i
	}()
}

func (f *fleet) url(i int) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.procs[i%len(f.procs)].url
}

// charge has auditClients clients make n charges, keyed prefix-0 on, each
// retried until it is answered 201, and returns the 201s in key order.
// Meanwhile it restarts every instance that dies, which must be by its own
// hand (-crash-after).
func (f *fleet) charge(t *testing.T, prefix string, n int) []auditAnswer {
	answers := make([]auditAnswer, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	c := &http.Client{Timeout: auditAttemptLimit}
	for range auditClients {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < n; i = int(next.Add(1)) - 1 {
				answers[i] = f.retry(t.Context(), c, fmt.Sprintf("%s-%d", prefix, i), 100+i)
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for {
		select {
		case <-done:
			for _, a := range answers {
				require.NoError(t, a.err, a.key)
			}
			return answers
		case i := <-f.exits:
			log := f.procs[i].stderr()
			require.Contains(t, log, "crash: killed right after step", "an instance died of something else:\n%s", log)
			f.kills++
			f.start(t, i)
		}
	}
}

// auditAnswer is what a client was answered for one charge.
type auditAnswer struct {
	key     string
	amount  int
	created reply
	err     error
}

// retry sends the charge under key to one instance after another until one
// answers 201. An instance that dies answers nothing, one whose owner died
// 409 or 503 until the lease has run out; a retry then takes over.
func (f *fleet) retry(ctx context.Context, c *http.Client, key string, amount int) auditAnswer {
	a := auditAnswer{key: key, amount: amount}
	deadline := time.Now().Add(auditKeyDeadline)
	for try, backoff := amount, 50*time.Millisecond; ; try, backoff = try+1, min(2*backoff, 500*time.Millisecond) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, f.url(try)+"/v1/charges", strings.NewReader(amountBody(amount)))
		if err != nil {
			a.err = err
			return a
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("X-Account-ID", testAccount)
		r, err := roundTrip(c, req)
		switch {
		case ctx.Err() != nil:
			a.err = ctx.Err()
			return a
		case err == nil && r.status == http.StatusCreated:
			a.created = r
			return a
		case err == nil && r.status != http.StatusConflict && r.status != http.StatusServiceUnavailable:
			a.err = fmt.Errorf("answered %s", r)
			return a
		case time.Now().After(deadline):
			a.err = fmt.Errorf("no 201 in %v; last %v %v", auditKeyDeadline, r, err)
			return a
		}
		time.Sleep(backoff)
	}
}

// requireReplays checks every charge's answer, and that every instance
// replays it byte for byte: all the retries of a charge get one answer.
func (f *fleet) requireReplays(t *testing.T, answers []auditAnswer) {
	ids := map[string]string{}
	for _, a := range answers {
		c := chargeOf(t, a.created)
		require.Equal(t, int64(a.amount), c.Amount, "%s was answered another charge", a.key)
		require.NotContains(t, ids, c.ID, "%s and %s were answered one charge", ids[c.ID], a.key)
		ids[c.ID] = a.key
		for i := range auditInstances {
			again, err := postCharge(f.url(i), a.key, "", amountBody(a.amount))
			require.NoError(t, err)
			requireReplayOf(t, a.created, again)
		}
	}
}

// stop kills the fleet's instances, which are idle: every charge was
// answered.
func (f *fleet) stop() {
	for _, in := range f.procs {
		_ = in.cmd.Process.Kill() // fails for one that is gone already
		<-in.exited
	}
}

// executions counts the rows of each step, by the operation they name (the
// gateway's calls name its downstream key, one per operation).
type executions map[string]map[string]int

// since returns the rows added after before was read.
func (e executions) since(before executions) executions {
	added := executions{}
	for step, byOp := range e {
		added[step] = map[string]int{}
		for op, n := range byOp {
			if d := n - before[step][op]; d > 0 {
				added[step][op] = d
			}
		}
	}
	return added
}

// row is the audit's row of a run of ops charges: every operation must have
// run every step at least once; a step run more than once is repeated.
func (e executions) row(t *testing.T, point string, ops int) auditRow {
	row := auditRow{point: point, ops: ops, runs: map[string]int{}}
	for _, step := range steps {
		assert.Len(t, e[step], ops, "after %s: operations that ran step %s", point, step)
		for _, n := range e[step] {
			row.runs[step] += n
			row.repeated += n - 1
		}
	}
	return row
}

func redisExecutions(t *testing.T, c *redis.Client) executions {
	ctx := t.Context()
	e := executions{"charge": {}}
	calls, err := c.LRange(ctx, gatewayCallsKey, 0, -1).Result()
	require.NoError(t, err)
	for _, key := range calls {
		e["charge"][key]++
	}
	for step, key := range map[string]string{"order": ordersKey, "receipt": receiptsKey} {
		rows, err := c.LRange(ctx, key, 0, -1).Result()
		require.NoError(t, err)
		e[step] = map[string]int{}
		for _, r := range rows {
			var v struct{ Operation string }
			require.NoError(t, json.Unmarshal([]byte(r), &v))
			e[step][v.Operation]++
		}
	}
	return e
}

func postgresExecutions(t *testing.T, dsn string) executions {
	ctx := t.Context()
	conn, err := pgx.Connect(ctx, dsn)
	require.NoError(t, err)
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	e := executions{}
	for step, query := range map[string]string{
		"order":   `SELECT operation, count(*) FROM payments_orders GROUP BY 1`,
		"charge":  `SELECT downstream_key, count(*) FROM payments_gateway_calls GROUP BY 1`,
		"receipt": `SELECT operation, count(*) FROM payments_receipts GROUP BY 1`,
	} {
		e[step] = map[string]int{}
		rows, _ := conn.Query(ctx, query)
		var (
			op string
			n  int
		)
		_, err := pgx.ForEachRow(rows, []any{&op, &n}, func() error { e[step][op] = n; return nil })
		require.NoError(t, err)
	}
	return e
}

// auditRow is what the audit found for one crash point.
type auditRow struct {
	point      string
	kills, ops int
	runs       map[string]int // by step
	repeated   int
}

type auditTable []auditRow

func (tb auditTable) total() auditRow {
	sum := auditRow{point: "all", runs: map[string]int{}}
	for _, r := range tb {
		sum.kills += r.kills
		sum.ops += r.ops
		sum.repeated += r.repeated
		for step, n := range r.runs {
			sum.runs[step] += n
		}
	}
	return sum
}

// format is the table of the audit's runs on store.
func (tb auditTable) format(store string) string {
	var b strings.Builder
	b.WriteString("| store | crash point | kills | operations | order runs | charge runs | receipt runs | repeated steps |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|\n")
	for _, r := range append(tb, tb.total()) {
		point := map[string]string{"order": "after order", "charge": "after charge",
			"receipt": "after receipt, before completion", "all": "all"}[r.point]
		fmt.Fprintf(&b, "| %s | %s | %d | %d | %d | %d | %d | %d |\n", store, point, r.kills, r.ops,
			r.runs["order"], r.runs["charge"], r.runs["receipt"], r.repeated)
	}
	return b.String()
}
