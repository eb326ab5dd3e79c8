package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/seal"
)

// row is one line of the table.
type row struct {
	name     string
	baseline string // the row whose throughput this one is compared with
	// concurrency overrides the -concurrency flag when non-zero.
	concurrency int
	footnote    string
	prepare     prepareFunc
}

// prepareFunc readies one run of a row (records to replay, say) and
// returns the operation to run; a skipped error means the row cannot run
// here. prefix is unique to the run of the row: every key it names starts
// with it, so that no run meets another's keys.
type prepareFunc func(ctx context.Context, prefix string) (timedOp, error)

// skipped says why a row cannot run here.
type skipped string

func (s skipped) Error() string { return string(s) }

// Row names. A name ending in @1 is its row at concurrency 1; the others
// run at the -concurrency flag's.
const (
	one, two                   = "baseline/one-roundtrip", "baseline/two-roundtrips"
	bareHTTP, httpOne, httpTwo = "baseline/http", "baseline/http-one-roundtrip", "baseline/http-two-roundtrips"
	newOp, replayOp            = "redis/new-operation", "redis/replay"
	httpNewOp, httpReplayOp    = "redis/http-new-operation", "redis/http-replay"
	pgNewOp                    = "postgres/new-operation"
)

func at1(name string) string { return name + "@1" }

// rows lists every row in the order one run runs them: each library row
// right after its baseline.
func (e *env) rows() []row {
	return []row{
		{name: two, prepare: e.twoRoundTrips},
		{name: newOp, baseline: two, prepare: e.newOperation(e.redisGuard, "")},
		{name: one, prepare: e.oneRoundTrip},
		{name: replayOp, baseline: one, prepare: e.replay(e.redisGuard, "")},
		{name: "redis/new-operation+slog", baseline: newOp, prepare: e.newOperation(e.slogGuard, ""),
			footnote: "with SlogObserver logging every event as JSON at Debug (to io.Discard)"},
		{name: "redis/replay+slog", baseline: replayOp, prepare: e.replay(e.slogGuard, "")},
		{name: "redis/new-operation+otel", baseline: newOp, prepare: e.newOperation(e.otelGuard, ""),
			footnote: "with the otel module's Observer on the SDK's meter and tracer providers, every span sampled, nothing exported"},
		{name: "redis/replay+otel", baseline: replayOp, prepare: e.replay(e.otelGuard, "")},
		{name: "redis/new-operation+sealed", baseline: newOp, prepare: e.newOperation(e.sealedGuard, ""),
			footnote: "through seal.Store: the fingerprint keyed, the response's body and header value sealed with AES-256-GCM (opened again in redis/replay+sealed)"},
		{name: "redis/replay+sealed", baseline: replayOp, prepare: e.replay(e.sealedGuard, "")},
		{name: bareHTTP, prepare: e.httpFresh("/bare"),
			footnote: "for scale: a handler that makes no Redis call, on the same server and client as the HTTP rows"},
		{name: httpTwo, prepare: e.httpFresh("/two"),
			footnote: "a handler making the two EVALSHAs of " + two + ", on the same server and client as the HTTP rows"},
		{name: httpNewOp, baseline: httpTwo, prepare: e.httpFresh("/guarded")},
		{name: httpOne, prepare: e.httpRecorded("/one"),
			footnote: "a handler making the EVALSHA of " + one + ", on the same server and client as the HTTP rows"},
		{name: httpReplayOp, baseline: httpOne, prepare: e.httpRecorded("/guarded")},
		{name: at1(two), concurrency: 1, prepare: e.twoRoundTrips},
		{name: at1(newOp), concurrency: 1, baseline: at1(two), prepare: e.newOperation(e.redisGuard, "")},
		{name: at1(one), concurrency: 1, prepare: e.oneRoundTrip},
		{name: at1(replayOp), concurrency: 1, baseline: at1(one), prepare: e.replay(e.redisGuard, "")},
		{name: at1(httpTwo), concurrency: 1, prepare: e.httpFresh("/two")},
		{name: at1(httpNewOp), concurrency: 1, baseline: at1(httpTwo), prepare: e.httpFresh("/guarded")},
		{name: "redis/wake-up", concurrency: 1, prepare: e.wakeUp,
			footnote: "one waiter at a time; from just before the owner's Complete until the waiter's Do returns"},
		{name: pgTwoStatements, prepare: e.pgNewOperationRow(naive.newOperation),
			footnote: "the seeds' naive table: INSERT … ON CONFLICT DO NOTHING RETURNING, then UPDATE … SET completed, autocommitted, through pgx"},
		{name: pgIndexed, baseline: pgTwoStatements, prepare: e.pgNewOperationRow(naive.indexedNewOperation),
			footnote: "the naive statements on a table with the store's token, expiry index and index of records in flight; the completion leaves that index"},
		{name: pgHOT, baseline: pgTwoStatements, prepare: e.pgNewOperationRow(naive.hotNewOperation),
			footnote: "baseline/postgres-indexed without the index of records in flight, its expiry index on a column the completion leaves: the completion is a HOT update"},
		{name: pgNewOp, baseline: pgTwoStatements, prepare: e.newOperation(e.pgGuard, e.pgSkip)},
		{name: pgOneSelect, prepare: e.pgOneSelectRow, footnote: "one SELECT of a completed key of the naive table"},
		{name: pgReplayOp, baseline: pgOneSelect, prepare: e.replay(e.pgGuard, e.pgSkip)},
		{name: pgOneTx, prepare: e.pgNewOperationRow(naive.oneTransaction),
			footnote: "the naive statements in one transaction, pipelined: BEGIN with the INSERT, the UPDATE with COMMIT"},
		{name: pgOneCommit, baseline: pgTwoStatements, prepare: e.newOperation(e.pgOneCommitGuard, e.pgSkip),
			footnote: "postgres.Store.OneCommit: the claim, the operation (no business write) and the answer in one transaction"},
		{name: pgOneReplay, baseline: pgOneSelect, prepare: e.replay(e.pgOneCommitGuard, e.pgSkip)},
		{name: at1(pgTwoStatements), concurrency: 1, prepare: e.pgNewOperationRow(naive.newOperation)},
		{name: at1(pgIndexed), concurrency: 1, baseline: at1(pgTwoStatements), prepare: e.pgNewOperationRow(naive.indexedNewOperation)},
		{name: at1(pgHOT), concurrency: 1, baseline: at1(pgTwoStatements), prepare: e.pgNewOperationRow(naive.hotNewOperation)},
		{name: at1(pgNewOp), concurrency: 1, baseline: at1(pgTwoStatements), prepare: e.newOperation(e.pgGuard, e.pgSkip)},
		{name: at1(pgOneSelect), concurrency: 1, prepare: e.pgOneSelectRow},
		{name: at1(pgReplayOp), concurrency: 1, baseline: at1(pgOneSelect), prepare: e.replay(e.pgGuard, e.pgSkip)},
		{name: at1(pgOneTx), concurrency: 1, prepare: e.pgNewOperationRow(naive.oneTransaction)},
		{name: at1(pgOneCommit), concurrency: 1, baseline: at1(pgTwoStatements), prepare: e.newOperation(e.pgOneCommitGuard, e.pgSkip)},
		{name: at1(pgOneReplay), concurrency: 1, baseline: at1(pgOneSelect), prepare: e.replay(e.pgOneCommitGuard, e.pgSkip)},
		{name: valkeyNewOp, prepare: e.newOperation(e.valkeyGuard, e.valkeySkip),
			footnote: "a new operation on valkey-server with appendonly yes, appendfsync always"},
		{name: fsyncNewOp, baseline: valkeyNewOp, prepare: e.newOperation(e.fsyncGuard, e.valkeySkip),
			footnote: "the same with RedisOptions.Fsync{Master: true}: the claim and the completion are confirmed fsynced (WAITAOF), and survive a power loss"},
		{name: at1(valkeyNewOp), concurrency: 1, prepare: e.newOperation(e.valkeyGuard, e.valkeySkip)},
		{name: at1(fsyncNewOp), concurrency: 1, baseline: at1(valkeyNewOp), prepare: e.newOperation(e.fsyncGuard, e.valkeySkip)},
		{name: "memory/new-operation", baseline: two, prepare: onMemory(e.newOperation)},
		{name: "memory/replay", baseline: one, prepare: onMemory(e.replay)},
		{name: "memory/new-operation+sealed", baseline: "memory/new-operation", prepare: onMemory(e.newOperation, sealedMemory)},
	}
}

// Every Guard row claims with one fingerprint and completes with one small
// response: fingerprinting is measured by the go test benchmarks.
var (
	fp          = idempotency.FingerprintOf("bench", requestBody)
	requestBody = []byte(`{"amount":1000,"currency":"eur","customer":"cus_42"}`)
	created     = idempotency.Response{
		Status: http.StatusCreated,
		Header: http.Header{"Content-Type": {"application/json"}},
		Body:   []byte(`{"id":"ch_1","status":"succeeded"}`),
	}
)

func create(context.Context) (idempotency.Response, error) { return created, nil }

// retention is how long every key of the bench lives, the library's records
// (the Options default) and the baselines' alike: long enough that none
// expires while the bench runs, which would cost the server time in some
// rows and not in others.
const retention = 24 * time.Hour

// freshKey names a key no other operation uses: w and i are unique within a
// run of a row, and prefix is unique to that run. Baseline and library rows
// build their keys the same way, at the same cost.
func freshKey(prefix string, w, i int) string {
	var b [64]byte
	k := append(b[:0], prefix...)
	k = strconv.AppendInt(k, int64(w), 10)
	k = append(k, '-')
	k = strconv.AppendInt(k, int64(i), 10)
	return string(k)
}

// baseKey is the Redis key of a baseline's name, spelled as the library
// spells a record's, idem:{tag}:0::name with one of 1024 hash tags chosen
// by a hash of the name, under a prefix of its own: as long as the
// library's keys, as costly to build, and spread over as many slots.
func (e *env) baseKey(name string) string {
	tag := maphash.String(e.seed, name) % 1024
	b := make([]byte, 0, len(name)+20)
	b = append(b, "base:{"...)
	b = strconv.AppendUint(b, tag, 10)
	b = append(b, "}:0::"...)
	return string(append(b, name...))
}

// replayKeys is how many completed records a replay row spreads its reads
// over.
const replayKeys = 1024

func keyNames(prefix string) []string {
	names := make([]string, replayKeys)
	for n := range names {
		names[n] = prefix + strconv.Itoa(n)
	}
	return names
}

// pick chooses which of replayKeys records worker w reads in its i-th
// operation, so that workers do not walk the records in step.
func pick(w, i int) int { return (w*131 + i) % replayKeys }

// each runs f for every n in [0, count) on concurrency goroutines and
// returns the first error.
func each(ctx context.Context, count, concurrency int, f func(ctx context.Context, n int) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	next := make(chan int)
	var wg sync.WaitGroup
	for range min(concurrency, count) {
		wg.Go(func() {
			for n := range next {
				if err := f(ctx, n); err != nil {
					cancel(err)
				}
			}
		})
	}
	for n := range count {
		select {
		case next <- n:
		case <-ctx.Done():
		}
	}
	close(next)
	wg.Wait()
	return context.Cause(ctx)
}

// setNX is the baseline: one trivial script, sent by EVALSHA through
// go-redis Script, one round trip per call: the bare cost the library is
// measured against.
var setNX = redis.NewScript(`if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end return 0`)

// setNXs runs setNX n times in sequence on the key of name.
func (e *env) setNXs(ctx context.Context, name string, n int) error {
	keys := []string{e.baseKey(name)}
	for range n {
		if err := setNX.Run(ctx, e.redis, keys, "v", retention.Milliseconds()).Err(); err != nil {
			return err
		}
	}
	return nil
}

// oneRoundTrip is the floor of a replay: one script on one of a set of
// existing keys.
func (e *env) oneRoundTrip(ctx context.Context, prefix string) (timedOp, error) {
	names := keyNames(prefix)
	err := each(ctx, len(names), e.concurrency, func(ctx context.Context, n int) error { return e.setNXs(ctx, names[n], 1) })
	return timed(func(ctx context.Context, w, i int) error { return e.setNXs(ctx, names[pick(w, i)], 1) }), err
}

// twoRoundTrips is the floor of a new operation: two scripts in sequence
// on a fresh key, the first creating it.
func (e *env) twoRoundTrips(_ context.Context, prefix string) (timedOp, error) {
	return timed(func(ctx context.Context, w, i int) error { return e.setNXs(ctx, freshKey(prefix, w, i), 2) }), nil
}

// newOperation runs Guard.Do on fresh keys: claim, run, complete.
func (e *env) newOperation(g *idempotency.Guard, skip string) prepareFunc {
	return func(_ context.Context, prefix string) (timedOp, error) {
		if g == nil {
			return nil, skipped(skip)
		}
		return timed(func(ctx context.Context, w, i int) error {
			r, err := g.Do(ctx, idempotency.Key{Name: freshKey(prefix, w, i)}, fp, create)
			if err == nil && r.Replayed {
				err = errors.New("a fresh key was replayed")
			}
			return err
		}), nil
	}
}

// replay runs Guard.Do on completed keys.
func (e *env) replay(g *idempotency.Guard, skip string) prepareFunc {
	return func(ctx context.Context, prefix string) (timedOp, error) {
		if g == nil {
			return nil, skipped(skip)
		}
		names := keyNames(prefix)
		err := each(ctx, len(names), e.concurrency, func(ctx context.Context, n int) error {
			_, err := g.Do(ctx, idempotency.Key{Name: names[n]}, fp, create)
			return err
		})
		return timed(func(ctx context.Context, w, i int) error {
			r, err := g.Do(ctx, idempotency.Key{Name: names[pick(w, i)]}, fp, create)
			if err == nil && !r.Replayed {
				err = errors.New("a completed key ran again")
			}
			return err
		}), err
	}
}

// onMemory gives each run of a memory row a Guard on an empty memory
// store, wrapped by each of wrap: once the run ends its records are
// garbage, not live heap that every later row's collections would have to
// mark.
func onMemory(rowOf func(*idempotency.Guard, string) prepareFunc, wrap ...func(idempotency.Store) (idempotency.Store, error)) prepareFunc {
	return func(ctx context.Context, prefix string) (timedOp, error) {
		// Every new operation of a run must fit: a full memory store refuses.
		var s idempotency.Store = idempotency.NewMemoryStore(idempotency.MemoryOptions{MaxRecords: 1 << 24})
		for _, w := range wrap {
			var err error
			if s, err = w(s); err != nil {
				return nil, err
			}
		}
		return rowOf(idempotency.New(s, idempotency.Options{Retention: retention}), "")(ctx, prefix)
	}
}

// sealedMemory wraps a memory row's store in a seal.Store.
func sealedMemory(s idempotency.Store) (idempotency.Store, error) {
	return seal.New(s, seal.Keys{Current: benchKey()})
}

// benchKey is a sealing key with a random secret: the bench's records
// never outlive it.
func benchKey() seal.Key {
	k := seal.Key{ID: 1}
	_, _ = rand.Read(k.Secret[:]) // never fails: see crypto/rand.Read
	return k
}

// handle is the HTTP rows' handler: it reads the request and creates.
func handle(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(created.Status)
	_, _ = w.Write(created.Body)
}

// setNXHandler is the HTTP floor of the library: handle, after n
// setNX round trips on the request's key, as the baseline rows make them.
func (e *env) setNXHandler(n int) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if err := e.setNXs(r.Context(), r.Header.Get(idempotency.HeaderKey), n); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		handle(w, r)
	}
}

// post sends the benchmark's request to path under key and checks the
// answer: 201, replayed or not as wanted.
func (e *env) post(ctx context.Context, path, key string, replayed bool) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.httpURL+path, bytes.NewReader(requestBody))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(idempotency.HeaderKey, key)
	resp, err := e.http.Do(req)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	switch {
	case err != nil:
		return err
	case resp.StatusCode != created.Status:
		return fmt.Errorf("POST %s: status %d", path, resp.StatusCode)
	case (resp.Header.Get(idempotency.HeaderReplayed) == "true") != replayed:
		return fmt.Errorf("POST %s: %s %q, want replayed %v", path, idempotency.HeaderReplayed, resp.Header.Get(idempotency.HeaderReplayed), replayed)
	}
	return nil
}

// httpFresh posts to path with fresh keys.
func (e *env) httpFresh(path string) prepareFunc {
	return func(_ context.Context, prefix string) (timedOp, error) {
		return timed(func(ctx context.Context, w, i int) error {
			return e.post(ctx, path, freshKey(prefix, w, i), false)
		}), nil
	}
}

// httpRecorded posts to path once with each of a set of keys, then again
// with those keys: the middleware (/guarded) then replays what it recorded.
func (e *env) httpRecorded(path string) prepareFunc {
	return func(ctx context.Context, prefix string) (timedOp, error) {
		names := keyNames(prefix)
		err := each(ctx, len(names), e.concurrency, func(ctx context.Context, n int) error {
			return e.post(ctx, path, names[n], false)
		})
		replayed := path == "/guarded"
		return timed(func(ctx context.Context, w, i int) error {
			return e.post(ctx, path, names[pick(w, i)], replayed)
		}), err
	}
}

// waker makes the wake-up samples: an owner claims a fresh key through the
// store, a duplicate waits in Guard.Do, and the owner completes.
type waker struct {
	ownerClient redis.UniversalClient // one connection, so MONITOR can tell the owner apart
	owner       *idempotency.RedisStore
	waiter      *idempotency.Guard
	registered  chan struct{}
}

// watchSignal tells when a waiter's watching claim found the record in
// flight: from then on the owner's completion publishes a wake-up.
type watchSignal struct {
	idempotency.Store
	registered chan struct{}
}

func (s watchSignal) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	c, err := s.Store.Claim(ctx, req)
	if err == nil && req.Watch && c.State == idempotency.InFlight {
		select {
		case s.registered <- struct{}{}:
		default:
		}
	}
	return c, err
}

func (e *env) newWaker() (*waker, error) {
	oc := e.newRedisClient(1)
	e.closers = append(e.closers, oc.Close)
	owner, err := idempotency.NewRedisStore(oc, idempotency.RedisOptions{})
	if err != nil {
		return nil, err
	}
	e.closers = append(e.closers, owner.Close)
	waits, err := idempotency.NewRedisStore(e.redis, idempotency.RedisOptions{})
	if err != nil {
		return nil, err
	}
	e.closers = append(e.closers, waits.Close)
	registered := make(chan struct{}, 1)
	// No re-check timer during a sample: the waiter is woken by pub/sub or
	// not at all.
	g := idempotency.New(watchSignal{waits, registered}, idempotency.Options{RecheckInterval: time.Minute, WaitTimeout: 10 * time.Second})
	return &waker{ownerClient: oc, owner: owner, waiter: g, registered: registered}, nil
}

func (e *env) wakeUp(_ context.Context, prefix string) (timedOp, error) {
	wk, err := e.newWaker()
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context, w, i int) (time.Duration, error) {
		return wk.sample(ctx, freshKey(prefix, w, i))
	}, nil
}

// sample returns the time from just before the owner's Complete until the
// waiting duplicate's Do returned the replay.
func (wk *waker) sample(ctx context.Context, name string) (time.Duration, error) {
	k := idempotency.Key{Name: name}
	c, err := wk.owner.Claim(ctx, idempotency.ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op_bench", Lease: time.Minute, Retention: time.Hour})
	if err != nil {
		return 0, err
	}
	if c.State != idempotency.Owner {
		return 0, fmt.Errorf("fresh key %s: claim state %d", name, c.State)
	}
	select {
	case <-wk.registered: // left over from an earlier sample's spurious wake-up
	default:
	}
	type returned struct {
		at  time.Time
		res idempotency.Result
		err error
	}
	done := make(chan returned, 1)
	go func() {
		res, err := wk.waiter.Do(ctx, k, fp, func(context.Context) (idempotency.Response, error) {
			return idempotency.Response{}, errors.New("the duplicate ran")
		})
		done <- returned{time.Now(), res, err}
	}()
	select {
	case <-wk.registered:
	case r := <-done:
		return 0, fmt.Errorf("the duplicate returned before it waited: %v", r.err)
	}
	start := time.Now()
	err = wk.owner.Complete(ctx, k, c.Token, created, time.Hour)
	r := <-done // within the wait timeout, even if Complete failed
	switch {
	case err != nil:
		return 0, err
	case r.err != nil:
		return 0, r.err
	case !r.res.Replayed:
		return 0, errors.New("the duplicate did not replay")
	}
	return r.at.Sub(start), nil
}

// waiterCommands counts, with MONITOR, the commands one waiting request
// sends to Redis: not the owner's, not those its scripts run, not
// connection handshakes.
func (e *env) waiterCommands(ctx context.Context) (map[string]int, error) {
	wk, err := e.newWaker()
	if err != nil {
		return nil, err
	}
	info, err := wk.ownerClient.Do(ctx, "CLIENT", "INFO").Text()
	if err != nil {
		return nil, err
	}
	var owner string
	for _, f := range strings.Fields(info) {
		if a, ok := strings.CutPrefix(f, "addr="); ok {
			owner = a
		}
	}

	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", e.monitorAddr)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(30 * time.Second)); err != nil {
		return nil, err
	}
	r := bufio.NewReader(conn)
	if _, err := conn.Write([]byte("MONITOR\r\n")); err != nil {
		return nil, err
	}
	if ok, err := r.ReadString('\n'); err != nil || ok != "+OK\r\n" {
		return nil, fmt.Errorf("MONITOR answered %q: %v", ok, err)
	}
	if _, err := wk.sample(ctx, e.run+"wake-count"); err != nil {
		return nil, err
	}
	// The waiter's UNSUBSCRIBE went out on another connection than the
	// marker will: give Redis a moment to read it first.
	sleep(ctx, 50*time.Millisecond)
	marker := fmt.Sprintf("end-of-count-%d", time.Now().UnixNano())
	if err := e.redis.Echo(ctx, marker).Err(); err != nil {
		return nil, err
	}
	counts := map[string]int{}
	for {
		// 1700000000.123456 [0 127.0.0.1:50244] "evalsha" "..." ...
		line, err := r.ReadString('\n')
		if err != nil {
			return nil, err
		}
		if strings.Contains(line, marker) {
			return counts, nil
		}
		_, rest, _ := strings.Cut(line, "[")
		client, cmd, ok := strings.Cut(rest, "] \"")
		if !ok || strings.HasSuffix(client, " lua") || strings.HasSuffix(client, " "+owner) {
			continue
		}
		switch name := strings.ToLower(cmd[:strings.IndexByte(cmd, '"')]); name {
		case "hello", "client", "ping":
		default:
			counts[name]++
		}
	}
}
