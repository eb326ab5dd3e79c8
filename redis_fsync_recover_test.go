package idempotency

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// serveBound bounds the polls below for a master set right to serve again:
// the back-off's cap (2s), an AOF rewrite on Valkey, and a loaded machine.
const serveBound = 20 * time.Second

// A refusal of RedisOptions.Fsync lasts no longer than its cause: a master
// found with appendonly no serves again once switched to appendonly yes,
// without a new store. Meanwhile its claims fail with errCannotFsync, not
// ErrUnavailable, the middleware answers 503 and runs nothing.
func TestRedisFsyncRecovers(t *testing.T) {
	ctx := t.Context()
	srv := testserver.StartRedis(t, "--appendfsync", "always") // and appendonly no
	admin := srv.Client()
	fp := FingerprintOf("charge", nil)

	// On both servers: once the back-off ends, one call asks the master
	// again, and the calls that come while it asks keep to the refusal,
	// sending nothing.
	t.Run("AskedAgainOnce", func(t *testing.T) {
		gate := &probeGate{started: make(chan struct{}), release: make(chan struct{})}
		c := srv.Client()
		c.AddHook(gate)
		s := newRedisStoreWith(t, c, RedisOptions{Fsync: Fsync{Master: true}})
		s.fsyncSchedule.first = time.Millisecond
		g := New(s, Options{})
		var op counted
		_, err := g.Do(ctx, Key{Name: "asked"}, fp, op.charge) // the first probe: not held
		require.ErrorIs(t, err, errCannotFsync)
		time.Sleep(20 * time.Millisecond) // past the back-off of 1ms
		gate.hold.Store(true)
		asked := make(chan error, 1)
		go func() {
			_, err := g.Do(ctx, Key{Name: "asked"}, fp, op.charge)
			asked <- err
		}()
		<-gate.started
		assert.Empty(t, countCommands(t, srv.Addr, func() {
			for range 5 {
				_, err := g.Do(ctx, Key{Name: "meanwhile"}, fp, op.charge)
				require.ErrorIs(t, err, errCannotFsync)
			}
		}), "a call while the master is being asked sent something")
		close(gate.release)
		require.ErrorIs(t, <-asked, errCannotFsync)
		assert.Equal(t, int32(2), gate.probes.Load(), "the probes: the first, and one after the back-off")
		assert.Zero(t, op.runs.Load(), "an operation ran")
		assert.Zero(t, admin.DBSize(ctx).Val(), "something was written")
	})

	t.Run("AppendonlySwitchedOn", func(t *testing.T) {
		skipWithoutWaitAOF(t, admin)
		g := New(newRedisStoreWith(t, srv.Client(), RedisOptions{Fsync: Fsync{Master: true}}), Options{})
		var op counted
		_, err := g.Do(ctx, Key{Name: "off"}, fp, op.charge)
		require.ErrorIs(t, err, errCannotFsync)
		assert.NotErrorIs(t, err, ErrUnavailable)
		assert.ErrorContains(t, err, srv.Addr+" has appendonly no")
		rr := httptest.NewRecorder()
		g.Middleware(MiddlewareOptions{Scope: SingleTenant, FailOpen: true})(
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { op.runs.Add(1) })).ServeHTTP(rr, keyed("off-http", "{}"))
		assert.Equal(t, http.StatusServiceUnavailable, rr.Code, "clients are told to retry")

		require.NoError(t, admin.ConfigSet(ctx, "appendonly", "yes").Err())
		start := time.Now()
		require.Eventually(t, func() bool {
			_, err = g.Do(ctx, Key{Name: "on"}, fp, op.charge)
			return err == nil
		}, serveBound, 20*time.Millisecond, "still refused after appendonly yes: %v", err)
		t.Logf("served again %v after appendonly yes", time.Since(start).Round(time.Millisecond))
		assert.Equal(t, int32(1), op.runs.Load(), "only the call that was served ran")
	})
}

// An operation that ran keeps its outcome when its master turns out unable
// to fsync (appendonly switched off while it ran): the completion is
// stored without the fsync, the error says so, and a retry replays it once
// the master can wait again. It does not run twice.
func TestRedisFsyncCompletionRefused(t *testing.T) {
	ctx := t.Context()
	srv := testserver.StartRedis(t, "--appendonly", "yes", "--appendfsync", "always")
	admin := srv.Client()
	skipWithoutWaitAOF(t, admin)
	fp := FingerprintOf("charge", nil)
	appendonly := func(ctx context.Context, v string) { require.NoError(t, admin.ConfigSet(ctx, "appendonly", v).Err()) }
	t.Cleanup(func() { admin.ConfigSet(context.Background(), "appendonly", "yes") })

	// The master is known able when the completion goes out, with its
	// WAITAOF, which is refused after the script ran.
	t.Run("AfterTheScript", func(t *testing.T) {
		g := New(newRedisStoreWith(t, srv.Client(), RedisOptions{Fsync: Fsync{Master: true}}), Options{})
		var op counted
		k := Key{Name: "after"}
		_, err := g.Do(ctx, k, fp, func(ctx context.Context) (Response, error) {
			appendonly(ctx, "no")
			return op.charge(ctx)
		})
		notFsynced(t, err, srv.Addr)
		replays(t, srv, g, k, &op)
	})

	// The master is known unable when the completion goes out: another
	// call found it so while the operation ran. The completion goes out
	// without a WAITAOF.
	t.Run("BeforeTheScript", func(t *testing.T) {
		appendonly(ctx, "yes")
		s := newRedisStoreWith(t, srv.Client(), RedisOptions{Fsync: Fsync{Master: true}})
		s.fsyncSchedule.first, s.fsyncSchedule.recheck = time.Hour, time.Hour // not asked again while this runs
		g := New(s, Options{})
		var op, ready counted
		k := Key{Name: "before"}
		// Valkey finishes the AOF rewrite that appendonly yes started.
		require.Eventually(t, func() bool {
			_, err := g.Do(ctx, Key{Name: "ready"}, fp, ready.charge)
			return err == nil
		}, serveBound, 20*time.Millisecond)
		var err error
		sent := countCommands(t, srv.Addr, func() {
			_, err = g.Do(ctx, k, fp, func(ctx context.Context) (Response, error) {
				appendonly(ctx, "no")
				_, err := g.Do(ctx, Key{Name: "finds-it-refused"}, fp, op.charge)
				assert.ErrorIs(t, err, errCannotFsync)
				return op.charge(ctx)
			})
		})
		notFsynced(t, err, srv.Addr)
		assert.Equal(t, 2, sent["waitaof"], "the two claims' WAITAOFs, none after the completion")
		replays(t, srv, New(newRedisStoreWith(t, srv.Client(), RedisOptions{Fsync: Fsync{Master: true}}), Options{}), k, &op)
	})
}

// notFsynced checks err, the failure of a completion that ran on a master
// unable to fsync: stored, not fsynced, and why.
func notFsynced(t *testing.T, err error, addr string) {
	t.Helper()
	require.ErrorIs(t, err, errNotFsynced)
	assert.ErrorIs(t, err, ErrUnavailable, "an owner's write not confirmed, as one whose wait timed out")
	assert.ErrorIs(t, err, errCannotFsync)
	assert.ErrorContains(t, err, addr+" has appendonly no")
	assert.ErrorContains(t, err, "stored on the master, but not fsynced")
}

// replays checks that the operation of k, which ran once (op), has its
// outcome stored though its master has appendonly no: a store without
// Fsync replays it at once, and g, refused meanwhile, once appendonly is
// yes again. It turns appendonly on.
func replays(t *testing.T, srv *testserver.Redis, g *Guard, k Key, op *counted) {
	t.Helper()
	ctx := t.Context()
	fp := FingerprintOf("charge", nil)
	r, err := New(newRedisStore(t, srv.Client()), Options{}).Do(ctx, k, fp, op.charge)
	require.NoError(t, err)
	assert.True(t, r.Replayed, "the outcome was not stored")
	assert.Equal(t, "charged", string(r.Response.Body))
	_, err = g.Do(ctx, k, fp, op.charge)
	require.ErrorIs(t, err, errCannotFsync, "a claim on the refused master")
	require.NoError(t, srv.Client().ConfigSet(ctx, "appendonly", "yes").Err())
	require.Eventually(t, func() bool {
		r, err = g.Do(ctx, k, fp, op.charge)
		return err == nil
	}, serveBound, 20*time.Millisecond, "still refused after appendonly yes: %v", err)
	assert.True(t, r.Replayed)
	assert.Equal(t, int32(1), op.runs.Load(), "the operation ran twice")
}

// With Fsync.Master, appendfsync everysec is refused (WAITAOF may answer
// there before the fsync), and always is served: a switch at run time
// either way takes effect without a new store.
func TestRedisFsyncEverysec(t *testing.T) {
	ctx := t.Context()
	srv := testserver.StartRedis(t, "--appendonly", "yes", "--appendfsync", "everysec")
	admin := srv.Client()
	skipWithoutWaitAOF(t, admin)
	s := newRedisStoreWith(t, srv.Client(), RedisOptions{Fsync: Fsync{Master: true}})
	s.fsyncSchedule.recheck = 50 * time.Millisecond
	g := New(s, Options{})
	fp := FingerprintOf("charge", nil)
	var op counted

	_, err := g.Do(ctx, Key{Name: "everysec"}, fp, op.charge)
	require.ErrorIs(t, err, errCannotFsync)
	assert.NotErrorIs(t, err, ErrUnavailable)
	assert.ErrorContains(t, err, srv.Addr+" has appendfsync everysec")
	assert.Zero(t, op.runs.Load(), "the operation ran")
	assert.Zero(t, admin.DBSize(ctx).Val(), "something was written")
	p, err := s.CheckPersistence(ctx)
	require.ErrorIs(t, err, errCannotFsync)
	assert.Equal(t, SurvivesProcessCrash, p.Survives)
	assert.Contains(t, p.Reason, "RedisOptions.Fsync.Master needs appendfsync always")

	require.NoError(t, admin.ConfigSet(ctx, "appendfsync", "always").Err())
	require.Eventually(t, func() bool {
		_, err = g.Do(ctx, Key{Name: "always"}, fp, op.charge)
		return err == nil
	}, serveBound, 20*time.Millisecond, "still refused after appendfsync always: %v", err)
	assert.Equal(t, int32(1), op.runs.Load())
	p, err = s.CheckPersistence(ctx)
	require.NoError(t, err)
	assert.Equal(t, SurvivesPowerLoss, p.Survives, p.Reason)

	// Back to everysec: refused once the master is checked again.
	require.NoError(t, admin.ConfigSet(ctx, "appendfsync", "everysec").Err())
	require.Eventually(t, func() bool {
		_, err = g.Do(ctx, Key{Name: "everysec-again"}, fp, op.charge)
		return err != nil
	}, serveBound, 20*time.Millisecond)
	require.ErrorIs(t, err, errCannotFsync)
	assert.ErrorContains(t, err, "has appendfsync everysec")
}

// probeGate counts the fsync probes (a pipeline that starts with WAITAOF)
// sent through its client and, once hold is set, holds each until release
// is closed, closing started when it holds the first.
type probeGate struct {
	probes  atomic.Int32
	hold    atomic.Bool
	started chan struct{}
	release chan struct{}
	once    atomic.Bool
}

func (g *probeGate) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) { return next(ctx, network, addr) }
}

func (g *probeGate) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (g *probeGate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if len(cmds) > 0 && strings.EqualFold(cmds[0].Name(), "waitaof") {
			g.probes.Add(1)
			if g.hold.Load() {
				if g.once.CompareAndSwap(false, true) {
					close(g.started)
				}
				<-g.release
			}
		}
		return next(ctx, cmds)
	}
}
