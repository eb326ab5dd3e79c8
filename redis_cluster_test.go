package idempotency

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// ClusterTests runs the Redis store's cluster tests on cl, a cluster of 3
// masters with a replica each. TestRedisCluster, in the external test
// package, calls it after the conformance suite, so that both share one
// cluster: starting one takes seconds. The last subtests fail masters over
// for good.
func ClusterTests(t *testing.T, cl *testserver.Cluster) {
	t.Run("NoLostWakeUp", func(t *testing.T) {
		noLostWakeUp(t, newRedisStore(t, cl.Client()))
	})
	t.Run("ConcurrentDuplicates", func(t *testing.T) { clusterDuplicates(t, cl) })
	t.Run("CheckEviction", func(t *testing.T) { clusterCheckEviction(t, cl) })
	t.Run("CheckPersistence", func(t *testing.T) { clusterCheckPersistence(t, cl) })
	t.Run("Fsync", func(t *testing.T) { clusterFsync(t, cl) })
	t.Run("BatchedCalls", func(t *testing.T) {
		cc := cl.Client()
		batchedCalls(t, cc, RedisOptions{}, func(ctx context.Context) error {
			return cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return c.ScriptFlush(ctx).Err() })
		})
	})
	t.Run("Middleware", func(t *testing.T) { clusterMiddleware(t, cl) })
	t.Run("SlotMigration", func(t *testing.T) { clusterSlotMigration(t, cl) })
	t.Run("ConfirmedClaimSurvivesFailover", func(t *testing.T) { clusterConfirmedClaim(t, cl) })
	t.Run("UnconfirmedClaimLostInFailover", func(t *testing.T) { clusterUnconfirmedClaim(t, cl) })
}

// clusterMiddleware runs the middleware's contract, concurrent duplicates
// and waiting on the cluster. Each store is fresh and empty by its own key
// prefix, the cluster being shared.
func clusterMiddleware(t *testing.T, cl *testserver.Cluster) {
	cc := cl.Client()
	var stores atomic.Int64
	fresh := func(t *testing.T) Store {
		s, err := NewRedisStore(cc, RedisOptions{Prefix: fmt.Sprintf("mw%d:", stores.Add(1))})
		require.NoError(t, err)
		t.Cleanup(func() { s.Close() })
		return s
	}
	t.Run("Contract", func(t *testing.T) { middlewareContract(t, fresh) })
	t.Run("ConcurrentDuplicates", func(t *testing.T) { middlewareConcurrentDuplicates(t, fresh) })
	t.Run("WaitsForOriginal", func(t *testing.T) { middlewareWaitsForOriginal(t, fresh) })
}

// clusterDuplicates sends 100 concurrent duplicates of a key on every
// master through the middleware, with the re-check timer out of the way:
// each handler runs once, and every duplicate is woken by sharded pub/sub,
// over one connection per master.
func clusterDuplicates(t *testing.T, cl *testserver.Cluster) {
	const dups = 100
	cc := cl.Client()
	s := newRedisStore(t, cc)
	keys := keysOnEveryMaster(t, cc, s, "dup")
	allWaiting, release := make(chan struct{}), make(chan struct{})
	counted := &subscribeCounter{Store: s, want: int64(len(keys) * (dups - 1)), all: allWaiting}
	var runs sync.Map // key name -> *atomic.Int64
	h := New(counted, Options{RecheckInterval: time.Hour, WaitTimeout: 20 * time.Second}).
		Middleware(MiddlewareOptions{Scope: SingleTenant})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := runs.LoadOrStore(r.Header.Get(HeaderKey), new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
		<-release
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "charged once for %s", r.Header.Get(HeaderKey))
	}))

	type answer struct {
		status   int
		body     string
		replayed string
	}
	answers := map[Key]*[dups]answer{}
	var wg sync.WaitGroup
	for _, k := range keys {
		a := new([dups]answer)
		answers[k] = a
		for i := range dups {
			wg.Go(func() {
				rr := serve(h, keyed(k.Name, `{"amount":100}`))
				a[i] = answer{rr.Code, rr.Body.String(), rr.Header().Get(HeaderReplayed)}
			})
		}
	}
	// The originals run until every duplicate waits. Then each master
	// serves one subscriber connection, the store's, whatever the number
	// of waiters.
	select {
	case <-allWaiting:
		for _, n := range cl.Nodes {
			if role(t, n.Addr) == "master" {
				assert.Equal(t, 1, pubsubClients(t, n.Addr), "pub/sub connections on %s", n.Addr)
			}
		}
	case <-time.After(10 * time.Second):
		t.Error("the duplicates did not all subscribe")
	}
	close(release)
	wg.Wait()

	for k, a := range answers {
		n, _ := runs.Load(k.Name)
		assert.Equal(t, int64(1), n.(*atomic.Int64).Load(), "runs of %s", k.Name)
		replays := 0
		for _, ans := range a {
			assert.Equal(t, http.StatusCreated, ans.status, "key %s", k.Name)
			assert.Equal(t, "charged once for "+k.Name, ans.body)
			if ans.replayed == "true" {
				replays++
			}
		}
		assert.Equal(t, dups-1, replays, "replays of %s", k.Name)
	}
}

// clusterSlotMigration moves a record's slot to another master while a
// duplicate waits for it: the waiter's subscription follows the slot, so
// the completion on the new master wakes it, though only pub/sub can.
func clusterSlotMigration(t *testing.T, cl *testserver.Cluster) {
	ctx := context.Background()
	cc := cl.Client()
	s := newRedisStore(t, cc)
	g := New(s, Options{RecheckInterval: time.Hour, WaitTimeout: 30 * time.Second})
	k, fp := Key{Name: "migrating"}, FingerprintOf("op", nil)
	rec, _ := s.recordKey(k)
	slot := int(cc.ClusterKeySlot(ctx, rec).Val())
	src := cl.MasterFor(rec).Addr
	var dst string
	for _, n := range cl.Nodes {
		if n.Addr != src && role(t, n.Addr) == "master" {
			dst = n.Addr
			break
		}
	}

	// A store with Replicas set, on a client that loads its slot map now,
	// before the move, and keeps it until a reply says it is stale: its
	// first claim in the slot after the move meets MOVED.
	durable, err := NewRedisStore(cl.Client(), RedisOptions{Replicas: 1})
	require.NoError(t, err)
	t.Cleanup(func() { durable.Close() })
	_, err = durable.master(ctx, rec)
	require.NoError(t, err)
	other := sameBucket(k, "migrating-durable")

	started, finish := make(chan struct{}), make(chan struct{})
	original := make(chan error, 1)
	go func() {
		_, err := g.Do(ctx, k, fp, func(context.Context) (Response, error) {
			close(started)
			<-finish
			return Response{Status: http.StatusCreated, Body: []byte("done")}, nil
		})
		original <- err
	}()
	<-started
	waited := make(chan Result, 1)
	go func() {
		r, err := g.Do(ctx, k, fp, func(context.Context) (Response, error) {
			t.Error("the duplicate ran the operation")
			return Response{}, nil
		})
		assert.NoError(t, err)
		waited <- r
	}()
	waitForWatcher(t, cc, s, k)
	assert.Equal(t, int64(1), shardSubscribers(t, src, rec), "subscribers on the slot's first master")

	migrateSlot(t, cl, slot, src, dst)
	require.Eventually(t, func() bool { return shardSubscribers(t, dst, rec) == 1 }, 10*time.Second, 10*time.Millisecond,
		"the waiter did not follow its slot to %s", dst)

	close(finish)
	select {
	case r := <-waited:
		assert.True(t, r.Replayed)
		assert.Equal(t, "done", string(r.Response.Body))
	case <-time.After(15 * time.Second):
		t.Fatal("the waiter was not woken on the slot's new master")
	}
	require.NoError(t, <-original)

	// The stale store's claim meets MOVED: the claim is made through the
	// cluster client, which follows the slot, but WAIT there could not
	// cover it, so it fails closed and gives the record up.
	_, err = durable.Claim(ctx, ClaimRequest{Key: other, Fingerprint: fp, OperationID: "op", Lease: time.Minute, Retention: time.Hour})
	require.ErrorIs(t, err, ErrUnavailable)
	assert.ErrorContains(t, err, "slot is moving")
	require.Eventually(t, func() bool {
		c, err := durable.Claim(ctx, ClaimRequest{Key: other, Fingerprint: fp, OperationID: "op", Lease: time.Minute, Retention: time.Hour})
		return err == nil && c.State == Owner && c.Attempt == 1
	}, 10*time.Second, 50*time.Millisecond, "claims with Replicas set did not recover after the move")
}

// clusterConfirmedClaim: with Replicas set, a claim is confirmed by the
// replica before the operation runs, so killing the master and promoting
// the replica keeps it: the retry finds it in flight, then replays, and the
// operation never runs again. A duplicate waiting meanwhile is woken.
func clusterConfirmedClaim(t *testing.T, cl *testserver.Cluster) {
	ctx := context.Background()
	cc := cl.Client()
	s, err := NewRedisStore(cc, RedisOptions{Replicas: 1, ReplicaTimeout: 500 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	g := New(s, Options{Lease: time.Minute, WaitTimeout: -1})
	k, fp := Key{Name: "confirmed"}, FingerprintOf("charge", nil)
	rec, _ := s.recordKey(k)
	master := cl.MasterFor(rec)
	replica := cl.ReplicaOf(master)
	require.NotNil(t, replica)

	var runs atomic.Int32
	started, finish := make(chan struct{}), make(chan struct{})
	original := make(chan error, 1)
	go func() {
		_, err := g.Do(ctx, k, fp, func(context.Context) (Response, error) {
			runs.Add(1)
			close(started)
			<-finish
			return Response{Status: http.StatusCreated, Body: []byte("charged")}, nil
		})
		original <- err
	}()
	<-started
	assert.Equal(t, "p", replicaRecord(t, replica.Addr, rec)[:1], "the replica holds the claim")
	// A duplicate waits through the failover: its subscription moves to the
	// new master, where the completion wakes it, though only pub/sub can.
	waited := make(chan Result, 1)
	go func() {
		r, err := New(s, Options{RecheckInterval: time.Hour, WaitTimeout: 30 * time.Second}).Do(ctx, k, fp,
			func(context.Context) (Response, error) {
				t.Error("the waiting duplicate ran the operation")
				return Response{}, nil
			})
		assert.NoError(t, err)
		waited <- r
	}()
	waitForWatcher(t, cc, s, k)

	master.Stop(t)
	promote(t, cc, replica, rec)
	retry := func() (Result, error) {
		return g.Do(ctx, k, fp, func(context.Context) (Response, error) {
			runs.Add(1)
			return Response{Status: http.StatusCreated, Body: []byte("charged again")}, nil
		})
	}
	// Right after a failover the cluster may still refuse a command; what
	// must never happen is the operation running again.
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if _, err = retry(); !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrInFlight) {
			break
		}
		t.Logf("retry during the failover: %v", err)
	}
	require.ErrorIs(t, err, ErrInFlight, "the retry after the failover")

	// The original completes on the new master, which has no replica left
	// to confirm it: it answers 503, yet the outcome is kept.
	close(finish)
	err = <-original
	require.ErrorIs(t, err, ErrUnavailable)
	assert.ErrorContains(t, err, "0 of 1 replicas acknowledged")
	r, err := retry()
	require.NoError(t, err)
	assert.True(t, r.Replayed)
	assert.Equal(t, "charged", string(r.Response.Body))
	select {
	case r := <-waited:
		assert.True(t, r.Replayed)
		assert.Equal(t, "charged", string(r.Response.Body))
	case <-time.After(20 * time.Second):
		t.Error("the waiter was not woken on the new master")
	}
	assert.Equal(t, int32(1), runs.Load())
}

// clusterUnconfirmedClaim shows the window that Replicas closes: without
// it, a claim the replica never received is gone after a failover, and the
// retry runs the operation a second time, under the same fencing token.
func clusterUnconfirmedClaim(t *testing.T, cl *testserver.Cluster) {
	ctx := context.Background()
	cc := cl.Client()
	s := newRedisStore(t, cc)
	// In about 2 runs of 5 the original's first EVALSHA, on a new
	// connection to the master, meets go-redis's 5s ReadTimeout once the
	// replica is frozen, and succeeds when go-redis sends it again: the
	// claim's bound leaves room for that, since this test is about what a
	// failover keeps, not about how long a claim may take.
	g := New(s, Options{Lease: time.Minute, WaitTimeout: -1, ClaimTimeout: 30 * time.Second})
	fp := FingerprintOf("charge", nil)
	// A key on a master that still has its replica.
	var k Key
	var master, replica *testserver.Redis
	for i := 0; replica == nil || !answers(replica.Addr); i++ {
		k = Key{Name: fmt.Sprintf("unconfirmed-%d", i)}
		rec, _ := s.recordKey(k)
		master = cl.MasterFor(rec)
		replica = cl.ReplicaOf(master)
	}

	// The replica, frozen, cannot reconnect once the master drops its
	// link: what the master writes next reaches no replica. (Freezing
	// alone would not do: the kernel still buffers the stream for it.)
	replica.Pause(t)
	require.NoError(t, withNode(master.Addr, func(c *redis.Client) error {
		return c.ClientKillByFilter(ctx, "TYPE", "replica").Err()
	}))
	var runs atomic.Int32
	tokens := make(chan uint64, 2)
	started, finish := make(chan struct{}), make(chan struct{})
	original := make(chan error, 1)
	go func() {
		_, err := g.Do(ctx, k, fp, func(ctx context.Context) (Response, error) {
			runs.Add(1)
			info, _ := FromContext(ctx)
			tokens <- info.Token
			close(started)
			<-finish
			return Response{Status: http.StatusCreated, Body: []byte("charged")}, nil
		})
		original <- err
	}()
	select {
	case <-started:
	case err := <-original:
		t.Fatalf("the original did not run: %v", err)
	}
	master.Stop(t)
	replica.Resume(t)
	rec, _ := s.recordKey(k)
	promote(t, cc, replica, rec)

	r, err := g.Do(ctx, k, fp, func(ctx context.Context) (Response, error) {
		runs.Add(1)
		info, _ := FromContext(ctx)
		assert.Equal(t, 1, info.Attempt, "the retry's claim made the record anew")
		tokens <- info.Token
		return Response{Status: http.StatusCreated, Body: []byte("charged again")}, nil
	})
	require.NoError(t, err)
	assert.False(t, r.Replayed)
	assert.Equal(t, int32(2), runs.Load(), "the operation ran twice")
	assert.Equal(t, <-tokens, <-tokens, "the lost claim's token was issued again")
	close(finish)
	assert.ErrorIs(t, <-original, ErrFenced)
}

// subscribeCounter closes all once want subscriptions have been confirmed.
type subscribeCounter struct {
	Store
	n    atomic.Int64
	want int64
	all  chan struct{}
}

func (s *subscribeCounter) Subscribe(ctx context.Context, k Key) (Subscription, error) {
	sub, err := s.Store.Subscribe(ctx, k)
	if err == nil && s.n.Add(1) == s.want {
		close(s.all)
	}
	return sub, err
}

// keysOnEveryMaster returns one key for each master, named prefix-N.
func keysOnEveryMaster(t *testing.T, cc *redis.ClusterClient, s *RedisStore, prefix string) []Key {
	ctx := context.Background()
	var mu sync.Mutex
	masters := map[string]bool{}
	require.NoError(t, cc.ForEachMaster(ctx, func(_ context.Context, c *redis.Client) error {
		mu.Lock()
		masters[c.Options().Addr] = false
		mu.Unlock()
		return nil
	}))
	var keys []Key
	for i := 0; len(keys) < len(masters); i++ {
		k := Key{Name: fmt.Sprintf("%s-%d", prefix, i)}
		rec, _ := s.recordKey(k)
		n, err := cc.MasterForKey(ctx, rec)
		require.NoError(t, err)
		if addr := n.Options().Addr; !masters[addr] {
			masters[addr] = true
			keys = append(keys, k)
		}
	}
	return keys
}

// sameBucket returns a key, named prefix-N, whose record shares k's bucket.
func sameBucket(k Key, prefix string) Key {
	for i := 0; ; i++ {
		o := Key{Scope: k.Scope, Name: fmt.Sprintf("%s-%d", prefix, i)}
		if bucketOf(o) == bucketOf(k) {
			return o
		}
	}
}

// migrateSlot moves slot from master src to master dst the way redis-cli
// --cluster reshard does: both ends marked, every key moved, then every
// master told the new owner, dst first.
func migrateSlot(t *testing.T, cl *testserver.Cluster, slot int, src, dst string) {
	ctx := context.Background()
	id := func(addr string) (id string) {
		require.NoError(t, withNode(addr, func(c *redis.Client) (err error) {
			id, err = c.ClusterMyID(ctx).Result()
			return err
		}))
		return id
	}
	srcID, dstID := id(src), id(dst)
	require.NoError(t, withNode(dst, func(c *redis.Client) error {
		return c.Do(ctx, "CLUSTER", "SETSLOT", slot, "IMPORTING", srcID).Err()
	}))
	host, port, err := net.SplitHostPort(dst)
	require.NoError(t, err)
	require.NoError(t, withNode(src, func(c *redis.Client) error {
		if err := c.Do(ctx, "CLUSTER", "SETSLOT", slot, "MIGRATING", dstID).Err(); err != nil {
			return err
		}
		keys, err := c.ClusterGetKeysInSlot(ctx, slot, 10000).Result()
		if err != nil || len(keys) == 0 {
			return fmt.Errorf("keys in slot %d: %v %v", slot, keys, err)
		}
		args := []any{"MIGRATE", host, port, "", 0, 5000, "KEYS"}
		for _, k := range keys {
			args = append(args, k)
		}
		return c.Do(ctx, args...).Err()
	}))
	order := []string{dst, src}
	for _, n := range cl.Nodes {
		if n.Addr != src && n.Addr != dst && role(t, n.Addr) == "master" {
			order = append(order, n.Addr)
		}
	}
	for _, addr := range order {
		require.NoError(t, withNode(addr, func(c *redis.Client) error {
			return c.Do(ctx, "CLUSTER", "SETSLOT", slot, "NODE", dstID).Err()
		}))
	}
}

// promote fails replica's dead master over to it, and returns once cc
// sends rec's commands to it.
func promote(t *testing.T, cc *redis.ClusterClient, replica *testserver.Redis, rec string) {
	ctx := context.Background()
	require.NoError(t, withNode(replica.Addr, func(c *redis.Client) error {
		return c.Do(ctx, "CLUSTER", "FAILOVER", "FORCE").Err()
	}))
	require.Eventually(t, func() bool { return role(t, replica.Addr) == "master" }, 10*time.Second, 20*time.Millisecond,
		"%s was not promoted", replica.Addr)
	require.Eventually(t, func() bool {
		cc.ReloadState(ctx)
		n, err := cc.MasterForKey(ctx, rec)
		return err == nil && n.Options().Addr == replica.Addr
	}, 10*time.Second, 50*time.Millisecond, "the client does not route to %s", replica.Addr)
}

// withNode runs f with a client of the one node at addr.
func withNode(addr string, f func(*redis.Client) error) error {
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer c.Close()
	return f(c)
}

// answers reports whether the node at addr answers PING.
func answers(addr string) bool {
	return withNode(addr, func(c *redis.Client) error { return c.Ping(context.Background()).Err() }) == nil
}

func role(t *testing.T, addr string) (role string) {
	require.NoError(t, withNode(addr, func(c *redis.Client) error {
		v, err := c.Do(context.Background(), "ROLE").Slice()
		if err == nil {
			role, _ = v[0].(string)
		}
		return err
	}))
	return role
}

// shardSubscribers counts the sharded subscribers of channel on the node at
// addr.
func shardSubscribers(t *testing.T, addr, channel string) (n int64) {
	require.NoError(t, withNode(addr, func(c *redis.Client) error {
		m, err := c.PubSubShardNumSub(context.Background(), channel).Result()
		n = m[channel]
		return err
	}))
	return n
}

// pubsubClients counts the connections in pub/sub mode on the node at addr.
func pubsubClients(t *testing.T, addr string) (n int) {
	require.NoError(t, withNode(addr, func(c *redis.Client) error {
		list, err := c.ClientList(context.Background()).Result()
		for line := range strings.Lines(list) {
			for _, f := range strings.Fields(line) {
				if v, ok := strings.CutPrefix(f, "ssub="); ok && v != "0" {
					n++
				}
			}
		}
		return err
	}))
	return n
}

// replicaRecord reads the record at key on the replica at addr.
func replicaRecord(t *testing.T, addr, key string) (v string) {
	require.NoError(t, withNode(addr, func(c *redis.Client) error {
		conn := c.Conn()
		defer conn.Close()
		if err := conn.ReadOnly(context.Background()).Err(); err != nil {
			return err
		}
		var err error
		v, err = conn.Get(context.Background(), key).Result()
		return err
	}))
	return v
}

// clusterCheckEviction: CheckEviction asks the replicas too, since a failover
// makes one a master, and names the node that may evict.
func clusterCheckEviction(t *testing.T, cl *testserver.Cluster) {
	ctx := t.Context()
	s := newRedisStore(t, cl.Client())
	require.NoError(t, s.CheckEviction(ctx))
	replica := cl.ReplicaOf(cl.MasterFor("k")).Client()
	require.NoError(t, replica.ConfigSet(ctx, "maxmemory", "1gb").Err())
	require.NoError(t, replica.ConfigSet(ctx, "maxmemory-policy", "allkeys-lfu").Err())
	t.Cleanup(func() { replica.ConfigSet(context.Background(), "maxmemory", "0") })
	err := s.CheckEviction(ctx)
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrUnavailable)
	assert.ErrorContains(t, err, replica.Options().Addr+" evicts")
	assert.ErrorContains(t, err, "allkeys-lfu")
}
