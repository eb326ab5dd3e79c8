package linearizable_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"maps"
	mrand "math/rand/v2"
	"net/url"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest/linearizable"
	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testkit/report"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
)

const (
	ocClients  = 12
	ocSlots    = 3 // keys in use at a time
	ocDuration = 4 * time.Second
	// ocLease is the owner's idle_in_transaction_session_timeout: far
	// above an operation's run, so that only the faults end transactions.
	ocLease = 2 * time.Second
	// ocApp names the backends of the Guards' pools, the ones killed.
	ocApp = "onecommit-history"
	// ocRecords and ocBusiness are the store's table and the operations'.
	ocRecords  = "onecommit_records"
	ocBusiness = "onecommit_business"
)

// errOp marks an operation's own failure: its transaction rolled back.
var errOp = errors.New("the operation failed")

// The one-commit mode (postgres.OneCommit) under concurrent duplicates,
// requests of another fingerprint and connections that die mid-operation,
// checked with porcupine against ocModel (onecommit_model_test.go):
// exactly once per key, the business row and the record committed
// together or not at all, answers consistent with one another in real
// time.
//
// Twelve clients share four Guards, each on a pool of its own. Eleven
// clients use three of them: one waits for a duplicate 5s, one only 20ms
// (in flight answers), and one reaches the server through a faultproxy
// that resets connections before a request, or after the server applied
// it but before its reply, and partitions the link for moments. Besides, a
// separate connection terminates (pg_terminate_backend) random backends of
// these pools that are idle in a transaction (mid-operation) or active.
// The twelfth client has the fourth Guard, on a proxy of its own and one
// connection, to itself: its operation arms the proxy's
// reset-after-a-request as it returns, so that its commit is applied and
// its reply lost (ErrUnavailable), and the client retries the key at once.
// It arms it only once its connection committed since it was made (every
// other operation it runs, then): a new connection prepares the commit's
// statement in a round trip of its own, which the reset would hit instead.
//
// The clients call Do on three keys at a time, now and then with the other
// request (B instead of A); a key is replaced by a new one now and then
// once it is answered (owner, replay or mismatch). Each operation inserts
// a business row naming its key and operation ID in its transaction and
// answers a body naming its operation ID; now and then it fails after its
// insert, or chooses Release. Clients also read keys, the record and the
// business rows in one statement, and every key is read once more when
// they stopped.
func TestPostgresOneCommit(t *testing.T) {
	pg := testserver.StartPostgres(t)
	admin := ocPool(t, pg.DSN, "onecommit-admin", 8)
	opts := postgres.Options{Table: ocRecords, Channel: "onecommit_wake"}
	require.NoError(t, postgres.New(admin, opts).Migrate(t.Context()))
	_, err := admin.Exec(t.Context(), "CREATE TABLE "+ocBusiness+" (scope text NOT NULL, key text NOT NULL, operation_id text NOT NULL)")
	require.NoError(t, err)

	guard := func(dsn, app string, conns int32, wait time.Duration) *idempotency.Guard {
		s := postgres.New(ocPool(t, dsn, app, conns), opts)
		t.Cleanup(s.Close)
		return idempotency.New(s.OneCommit(), idempotency.Options{Lease: ocLease,
			Retention: time.Hour, WaitTimeout: wait, OperationTimeout: 5 * time.Second})
	}
	proxy, proxied := ocProxy(t, pg.DSN)
	lossy, lossyDSN := ocProxy(t, pg.DSN)
	guards := []*idempotency.Guard{
		guard(pg.DSN, ocApp, 8, 5*time.Second),
		guard(pg.DSN, ocApp, 8, 20*time.Millisecond),
		guard(proxied, ocApp, 8, 5*time.Second),
	}
	clients := []*ocClient{{id: ocClients - 1, g: guard(lossyDSN, "onecommit-lossy", 1, 5*time.Second), lossy: lossy}}
	for id := range ocClients - 1 {
		clients = append(clients, &ocClient{id: id, g: guards[id%len(guards)]})
	}

	h := &ocHistory{start: time.Now(), scope: "onecommit-" + rand.Text(), reader: admin, gen: make([]int, ocSlots)}
	ctx, stop := context.WithCancel(t.Context())
	var faults sync.WaitGroup
	kills := map[string]int{}
	var proxyFaults map[string]int
	faults.Go(func() { kills = ocKill(ctx, admin) })
	// Most often a reset after a request; a short latency stretches the
	// window in which a commit is in flight.
	faults.Go(func() {
		proxyFaults = inject(ctx, proxy, faultMix{every: 30 * time.Millisecond, spread: 100 * time.Millisecond,
			resetAfter: 3, partition: 30 * time.Millisecond, latency: 5 * time.Millisecond})
	})
	until := h.start.Add(ocDuration)
	var running sync.WaitGroup
	for _, c := range clients {
		running.Go(func() {
			for time.Now().Before(until) && t.Context().Err() == nil {
				h.visit(t.Context(), c)
			}
		})
	}
	ended := make(chan struct{})
	go func() { running.Wait(); close(ended) }()
	select {
	case <-ended:
	case <-time.After(ocDuration + time.Minute):
		// Each Do is bounded (the wait, the lease, OperationTimeout).
		t.Fatal("a client's call still runs a minute after the history's end")
	}
	stop()
	faults.Wait()
	for _, k := range h.keys() {
		require.NoError(t, h.read(t.Context(), ocClients*2, k), "the final read of %s", k)
	}
	for _, b := range h.breaches {
		t.Error(b)
	}

	answers := map[string]int{}
	var unknownRan, unknownCommitted, reads int
	final := map[string]string{} // key: the operation ID its final read found
	for _, op := range h.ops {
		in, out := op.Input.(ocIn), op.Output.(ocOut)
		if in.kind == ocRead {
			reads++
			final[in.key] = out.recOpID // the final read is each key's last
		}
	}
	for _, op := range h.ops {
		in, out := op.Input.(ocIn), op.Output.(ocOut)
		if in.kind != ocDo {
			continue
		}
		answers[out.answer.String()]++
		if out.answer == ocUnknown && in.opID != "" {
			unknownRan++
			if final[in.key] == in.opID {
				unknownCommitted++
			}
		}
	}
	calls := 0
	for _, n := range answers {
		calls += n
	}
	t.Logf("one-commit: %d calls on %d keys (%d owners, %d replays, %d mismatches, %d in flight, %d failed, %d released, "+
		"%d unknown: %d of them ran their operation, %d of those committed it), %d reads; kills %v, proxy faults %v",
		calls, len(final), answers["owner"], answers["replay"], answers["mismatch"], answers["in flight"], answers["failed"],
		answers["released"], answers["unknown"], unknownRan, unknownCommitted, reads, kills, proxyFaults)

	verdict, info := porcupine.CheckOperationsVerbose(ocModel, h.ops, 15*time.Second)
	faultCounts := maps.Clone(kills)
	maps.Copy(faultCounts, proxyFaults)
	report.Add(t, report.Entry{Suite: "linearizable", Store: "postgres", Faults: faultCounts, Operations: calls,
		Linearizable: string(verdict), Notes: fmt.Sprintf("one-commit mode: %d keys, %d owners, %d replays, %d mismatches, %d outcomes unknown",
			len(final), answers["owner"], answers["replay"], answers["mismatch"], answers["unknown"])})
	if verdict != porcupine.Ok {
		for _, part := range ocModel.Partition(h.ops) {
			if porcupine.CheckOperationsTimeout(ocModel, part, 15*time.Second) != porcupine.Ok {
				t.Logf("the calls on %s, which are not linearizable:\n%s", part[0].Input.(ocIn).key, linearizable.Listing(part, func(op porcupine.Operation) string { return ocDescribe(op.Input.(ocIn), op.Output.(ocOut)) }))
				break
			}
		}
		path := filepath.Join(t.ArtifactDir(), "onecommit.html")
		if err := porcupine.VisualizePath(ocModel, info, path); err != nil {
			t.Errorf("writing the visualization: %v", err)
		}
		t.Fatalf("the one-commit history of %d calls is %s; its visualization is %s (go test -artifacts keeps it)", calls, verdict, path)
	}

	// The same exactly-once, said plainly on the final tables: each
	// business row's operation is its key's record's, once.
	var twice, orphans, bare int
	require.NoError(t, admin.QueryRow(t.Context(), `SELECT
		(SELECT count(*) FROM (SELECT 1 FROM `+ocBusiness+` GROUP BY scope, key HAVING count(*) > 1) d),
		(SELECT count(*) FROM `+ocBusiness+` b WHERE NOT EXISTS (SELECT 1 FROM `+ocRecords+` r
			WHERE r.scope = b.scope AND r.key = b.key AND r.operation_id = b.operation_id AND r.response IS NOT NULL)),
		(SELECT count(*) FROM `+ocRecords+` r WHERE NOT EXISTS (SELECT 1 FROM `+ocBusiness+` b
			WHERE b.scope = r.scope AND b.key = r.key AND b.operation_id = r.operation_id))`).Scan(&twice, &orphans, &bare))
	assert.Zero(t, twice, "keys with more than one business row")
	assert.Zero(t, orphans, "business rows without their record")
	assert.Zero(t, bare, "records without their business row")

	// The history must have met what it checks.
	assert.Positive(t, answers["owner"], "owners")
	assert.Positive(t, answers["replay"], "replays")
	assert.Positive(t, answers["mismatch"], "mismatches")
	assert.Positive(t, answers["unknown"], "no call failed with ErrUnavailable: the faults missed")
	assert.Positive(t, unknownRan, "no operation was cut off mid-way")
	assert.Positive(t, unknownCommitted, "no commit was applied with its reply lost")
	assert.Positive(t, kills["terminated"], "no backend was terminated")
}

// ocPool is a pool of conns connections on dsn, whose backends are named
// app.
func ocPool(t *testing.T, dsn, app string, conns int32) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(dsn)
	require.NoError(t, err)
	cfg.MaxConns = conns
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// ocProxy is a faultproxy to the server of dsn, and the DSN through it.
func ocProxy(t *testing.T, dsn string) (*faultproxy.Proxy, string) {
	u, err := url.Parse(dsn)
	require.NoError(t, err)
	p := faultproxy.Start(t, u.Host)
	u.Host = p.Addr()
	return p, u.String()
}

// ocClient is one client of the history.
type ocClient struct {
	id int
	g  *idempotency.Guard
	// lossy, when set, is the proxy of g's one connection, to this client
	// alone, whose reset-after-a-request the client's operations arm.
	lossy *faultproxy.Proxy
	// warm: the connection committed since it was made, and so holds the
	// commit's prepared statement.
	warm bool
	// retry is the key to call again, after a commit whose reply was lost.
	retry string
}

// ocHistory is what the clients did, and the keys they share.
type ocHistory struct {
	start  time.Time
	scope  string
	reader *pgxpool.Pool

	mu       sync.Mutex
	ops      []porcupine.Operation
	breaches []string
	gen      []int           // each slot's key's generation
	used     map[string]bool // every key named
}

func (h *ocHistory) now() int64 { return int64(time.Since(h.start)) }

func (h *ocHistory) add(client int, in ocIn, out ocOut, call, ret int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ops = append(h.ops, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
}

func (h *ocHistory) breach(format string, args ...any) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.breaches = append(h.breaches, fmt.Sprintf(format, args...))
}

// pick names the key of a random slot.
func (h *ocHistory) pick() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	slot := mrand.N(len(h.gen))
	k := fmt.Sprintf("k%d.%d", slot, h.gen[slot])
	if h.used == nil {
		h.used = map[string]bool{}
	}
	h.used[k] = true
	return k
}

// answered moves k's slot on to a new key, unless another client did.
func (h *ocHistory) answered(k string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for slot, g := range h.gen {
		if k == fmt.Sprintf("k%d.%d", slot, g) {
			h.gen[slot]++
		}
	}
}

func (h *ocHistory) keys() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Sorted(maps.Keys(h.used))
}

// visit reads a key, or calls Do on it as c.
func (h *ocHistory) visit(ctx context.Context, c *ocClient) {
	name, fp := c.retry, byte('A')
	if name == "" {
		name = h.pick()
		if mrand.N(6) == 0 {
			_ = h.read(ctx, c.id, name) // a read that fails saw nothing: it is left out
			return
		}
		if mrand.N(6) == 0 {
			fp = 'B'
		}
	}
	c.retry = ""
	k := idempotency.Key{Scope: h.scope, Name: name}
	fail, release := mrand.N(25) == 0, mrand.N(25) == 0
	loseCommit := c.lossy != nil && c.warm && !fail && !release
	var ran []string
	var ranAt int64
	op := func(ctx context.Context) (idempotency.Response, error) {
		info, _ := idempotency.FromContext(ctx)
		ran, ranAt = append(ran, info.OperationID), h.now()
		tx, ok := postgres.TxFromContext(ctx)
		if !ok {
			h.breach("%s: an operation without its transaction", name)
			return idempotency.Response{}, errOp
		}
		// Idle in the transaction for a moment before and after the
		// business write: the kills land mid-operation.
		time.Sleep(mrand.N(8 * time.Millisecond))
		if _, err := tx.Exec(ctx, "INSERT INTO "+ocBusiness+" (scope, key, operation_id) VALUES ($1, $2, $3)",
			h.scope, name, info.OperationID); err != nil {
			return idempotency.Response{}, fmt.Errorf("%w: %w", errOp, err)
		}
		time.Sleep(mrand.N(8 * time.Millisecond))
		if fail {
			return idempotency.Response{}, fmt.Errorf("%w: on purpose, after its business write", errOp)
		}
		if release {
			idempotency.SetDisposition(ctx, idempotency.Release)
		}
		if loseCommit {
			// The commit is the connection's next request.
			c.lossy.ResetOnNextRequest(true)
		}
		return idempotency.Response{Status: ocStatus, Body: []byte(ocBody(info.OperationID))}, nil
	}
	cctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	call := h.now()
	res, err := c.g.Do(cctx, k, idempotency.FingerprintOf("onecommit", []byte{fp}), op)
	ret := h.now()
	cancel()

	in := ocIn{kind: ocDo, key: name, fp: fp}
	if len(ran) > 1 {
		h.breach("%s: one Do ran its operation %d times: %v", name, len(ran), ran)
	}
	if len(ran) > 0 {
		in.opID = ran[0]
		h.add(ocClients+c.id, ocIn{kind: ocRan, key: name, fp: fp, opID: in.opID}, ocOut{}, call, ranAt)
	}
	out := ocOut{opID: res.OperationID, status: res.Response.Status, body: string(res.Response.Body)}
	switch {
	case err == nil && res.Replayed:
		out.answer = ocReplay
	case err == nil && release:
		out.answer = ocReleased
	case err == nil:
		out.answer = ocOwner
	case errors.Is(err, idempotency.ErrUnavailable):
		out, ret = ocOut{answer: ocUnknown}, ocNever
	case errors.Is(err, idempotency.ErrMismatch):
		out = ocOut{answer: ocMismatch}
	case errors.Is(err, idempotency.ErrInFlight):
		out = ocOut{answer: ocInFlight}
	case errors.Is(err, errOp):
		out = ocOut{answer: ocFailed}
	default:
		h.breach("%s: Do answered %v, outside the contract", name, err)
		out, ret = ocOut{answer: ocUnknown}, ocNever
	}
	h.add(c.id, in, out, call, ret)
	switch {
	case out.answer == ocOwner:
		c.warm = true
	case out.answer == ocUnknown:
		c.warm = false
		if loseCommit {
			c.retry = name // as its client would
		}
	}
	if (out.answer == ocOwner || out.answer == ocReplay || out.answer == ocMismatch) && mrand.N(3) == 0 {
		h.answered(name)
	}
}

// read reads the record of key name and its business rows in one
// statement, one snapshot, and records it.
func (h *ocHistory) read(ctx context.Context, client int, name string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	call := h.now()
	var fp []byte
	var opID *string
	var resp *bool
	var business string
	err := h.reader.QueryRow(ctx, `SELECT r.fingerprint, r.operation_id, r.response IS NOT NULL, b.ids
		FROM (SELECT coalesce(string_agg(operation_id, ',' ORDER BY operation_id), '') AS ids
			FROM `+ocBusiness+` WHERE scope = $1 AND key = $2) b
		LEFT JOIN `+ocRecords+` r ON r.scope = $1 AND r.key = $2`, h.scope, name).Scan(&fp, &opID, &resp, &business)
	ret := h.now()
	if err != nil {
		return err
	}
	out := ocOut{business: business}
	if opID != nil {
		out.recOpID, out.recResp, out.recFP = *opID, *resp, '?'
		for _, label := range []byte("AB") {
			if f := idempotency.FingerprintOf("onecommit", []byte{label}); string(f[:]) == string(fp) {
				out.recFP = label
			}
		}
	}
	h.add(client, ocIn{kind: ocRead, key: name}, out, call, ret)
	return nil
}

// ocKill terminates, every 20 to 100ms until ctx is done, one random
// backend of the Guards' pools: idle in a transaction (an operation
// running) three times in four, else active (a claim, a wait on a
// duplicate, a business write or a commit).
func ocKill(ctx context.Context, admin *pgxpool.Pool) map[string]int {
	n := map[string]int{}
	for {
		select {
		case <-ctx.Done():
			return n
		case <-time.After(20*time.Millisecond + mrand.N(80*time.Millisecond)):
		}
		state := "idle in transaction"
		if mrand.N(4) == 0 {
			state = "active"
		}
		var killed bool
		err := admin.QueryRow(ctx, `WITH victim AS MATERIALIZED (
				SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND state = $2 ORDER BY random() LIMIT 1)
			SELECT coalesce(bool_or(pg_terminate_backend(pid)), false) FROM victim`, ocApp, state).Scan(&killed)
		if err == nil && killed {
			n["terminated"]++
			n["terminated "+state]++
		}
	}
}
