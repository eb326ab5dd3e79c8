package testserver

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// DefaultNodeTimeout is the cluster-node-timeout StartCluster uses: short, so
// that failover tests finish quickly, but long enough that a busy CI machine
// does not see spurious failovers.
const DefaultNodeTimeout = 2 * time.Second

// Cluster is a Redis Cluster of redis-server processes (or of the server
// RedisServerEnv names) owned by one test.
type Cluster struct {
	// Addrs lists every node's address, masters and replicas, in start order.
	Addrs []string
	// Nodes are the node processes, in the same order as Addrs. Which of them
	// are masters is decided by redis-cli and can change on failover: use
	// MasterFor and ReplicaOf rather than positions.
	Nodes []*Redis
	// NodeTimeout is the cluster-node-timeout the nodes run with; a stopped
	// master is failed over after about twice this.
	NodeTimeout time.Duration

	t        testing.TB
	replicas int               // per master, as configured
	ids      map[*Redis]string // node IDs, stable across Restart as nodes.conf survives
}

// ClusterConfig describes a cluster for StartClusterWith.
type ClusterConfig struct {
	// Masters is the number of masters; redis-cli needs at least 3.
	Masters int
	// ReplicasPerMaster is the number of replicas of each master.
	ReplicasPerMaster int
	// NodeTimeout is cluster-node-timeout; zero means DefaultNodeTimeout.
	NodeTimeout time.Duration
	// ExtraArgs are appended to every node's command line, for example
	// "--cluster-require-full-coverage", "no".
	ExtraArgs []string
}

// StartCluster starts a Redis Cluster of masters masters with
// replicasPerMaster replicas each, and returns once every node reports
// cluster_state:ok, all nodes agree on the slot map and every replica's link
// to its master is up.
func StartCluster(t testing.TB, masters, replicasPerMaster int) *Cluster {
	t.Helper()
	return StartClusterWith(t, ClusterConfig{Masters: masters, ReplicasPerMaster: replicasPerMaster})
}

// StartClusterWith is StartCluster with every knob exposed.
func StartClusterWith(t testing.TB, cfg ClusterConfig) *Cluster {
	t.Helper()
	if cfg.Masters < 3 {
		t.Fatalf("testserver: a Redis Cluster needs at least 3 masters, got %d", cfg.Masters)
	}
	if cfg.ReplicasPerMaster < 0 {
		t.Fatalf("testserver: negative replicas per master: %d", cfg.ReplicasPerMaster)
	}
	if cfg.NodeTimeout <= 0 {
		cfg.NodeTimeout = DefaultNodeTimeout
	}
	cli := redisCLI(RedisServer())
	cli = lookBinary(t, cli, redisHint(cli))

	c := &Cluster{t: t, NodeTimeout: cfg.NodeTimeout, ids: map[*Redis]string{}}
	n := cfg.Masters * (1 + cfg.ReplicasPerMaster)
	for range n {
		// Two ports per node: the default bus port is port+10000, which
		// redis-server refuses when port > 55535 — and free ports come from
		// the ephemeral range, which reaches 60999 on Linux.
		node := startRedis(t, 2, func(ports []int, dir string) []string {
			return append([]string{
				"--cluster-enabled", "yes",
				"--cluster-config-file", filepath.Join(dir, fmt.Sprintf("nodes-%d.conf", ports[0])),
				"--cluster-node-timeout", strconv.FormatInt(cfg.NodeTimeout.Milliseconds(), 10),
				"--cluster-port", strconv.Itoa(ports[1]),
				// CLUSTER SLOTS lists a replica only once its replication
				// offset is non-zero; on an empty master that takes the first
				// master-to-replica PING, by default 10 s after the sync.
				"--repl-ping-replica-period", "1",
			}, cfg.ExtraArgs...)
		})
		c.Nodes = append(c.Nodes, node)
		c.Addrs = append(c.Addrs, node.Addr)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	args := append([]string{"--cluster", "create"}, c.Addrs...)
	args = append(args, "--cluster-replicas", strconv.Itoa(cfg.ReplicasPerMaster), "--cluster-yes")
	cmd := exec.CommandContext(ctx, cli, args...)
	cmd.SysProcAttr = newProcAttr()
	cmd.WaitDelay = time.Second
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("testserver: %s --cluster create: %v\n%s", filepath.Base(cli), err, tail(out, 8<<10))
	}

	for _, node := range c.Nodes {
		err := withClient(node.Addr, func(cl *redis.Client) error {
			id, err := cl.Do(ctx, "CLUSTER", "MYID").Text()
			c.ids[node] = id
			return err
		})
		if err != nil {
			t.Fatalf("testserver: CLUSTER MYID on %s: %v", node.Addr, err)
		}
	}
	c.replicas = cfg.ReplicasPerMaster
	c.WaitReady(t)
	return c
}

// withClient runs f with a short-lived client whose short timeouts and lack
// of retries keep a stopped or paused node from stalling the caller.
func withClient(addr string, f func(*redis.Client) error) error {
	cl := redis.NewClient(&redis.Options{
		Addr:         addr,
		DialTimeout:  500 * time.Millisecond,
		ReadTimeout:  time.Second,
		WriteTimeout: time.Second,
		MaxRetries:   -1,
		PoolSize:     1,
	})
	defer cl.Close()
	return f(cl)
}

// WaitReady waits until the cluster is whole: every node answers and
// reports cluster_state:ok, all agree on one slot map that covers every slot
// with a master and the configured number of replicas, and every replica's
// link is up. StartCluster calls it; call it again after stopping,
// restarting or pausing nodes. A restarted master refuses queries for 2 s
// (Redis's CLUSTER_WRITABLE_DELAY), so expect at least that. After a failover
// masters and replicas may have swapped; that still counts as whole.
func (c *Cluster) WaitReady(t testing.TB) {
	t.Helper()
	// redis-cli returns once the nodes have met, but gossip still has to
	// spread the final roles and replicas still have to sync: a client that
	// looked earlier could cache a slot map that is about to change.
	deadline := time.Now().Add(readinessDeadline)
	for {
		err := c.checkReady(c.replicas)
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			var logs strings.Builder
			for _, node := range c.Nodes {
				fmt.Fprintf(&logs, "--- %s ---\n%s\n", node.Addr, tail([]byte(readLog(node.logPath)), 2<<10))
			}
			t.Fatalf("testserver: cluster not ready after %v: %v\n%s", readinessDeadline, err, logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (c *Cluster) checkReady(replicas int) error {
	ctx := context.Background()
	var first string
	for _, node := range c.Nodes {
		err := withClient(node.Addr, func(cl *redis.Client) error {
			info, err := cl.ClusterInfo(ctx).Result()
			if err != nil {
				return err
			}
			fields := infoFields(info)
			if fields["cluster_state"] != "ok" {
				return fmt.Errorf("cluster_state:%s", fields["cluster_state"])
			}
			if fields["cluster_known_nodes"] != strconv.Itoa(len(c.Nodes)) {
				return fmt.Errorf("knows %s of %d nodes", fields["cluster_known_nodes"], len(c.Nodes))
			}

			slots, err := cl.ClusterSlots(ctx).Result()
			if err != nil {
				return err
			}
			view, err := slotView(slots, replicas, len(c.Nodes))
			if err != nil {
				return err
			}
			if first == "" {
				first = view
			} else if view != first {
				return fmt.Errorf("slot map differs from %s's view:\n%s\nvs\n%s", c.Nodes[0].Addr, view, first)
			}

			repl, err := cl.Info(ctx, "replication").Result()
			if err != nil {
				return err
			}
			fields = infoFields(repl)
			if fields["role"] == "slave" && fields["master_link_status"] != "up" {
				return fmt.Errorf("replica link to %s:%s is %s", fields["master_host"], fields["master_port"], fields["master_link_status"])
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("node %s: %w", node.Addr, err)
		}
	}
	return nil
}

// slotView renders CLUSTER SLOTS canonically so that views from different
// nodes can be compared, and checks that it covers every slot and node.
func slotView(slots []redis.ClusterSlot, replicas, nodes int) (string, error) {
	slices.SortFunc(slots, func(a, b redis.ClusterSlot) int { return a.Start - b.Start })
	var b strings.Builder
	next := 0
	seen := map[string]bool{}
	for _, s := range slots {
		if s.Start != next {
			return "", fmt.Errorf("slots %d-%d unassigned", next, s.Start-1)
		}
		next = s.End + 1
		if len(s.Nodes) != 1+replicas {
			return "", fmt.Errorf("slots %d-%d served by %d nodes, want %d", s.Start, s.End, len(s.Nodes), 1+replicas)
		}
		addrs := make([]string, 0, len(s.Nodes))
		for _, n := range s.Nodes {
			addrs = append(addrs, n.Addr)
			seen[n.Addr] = true
		}
		// The master comes first; replica order is not significant.
		slices.Sort(addrs[1:])
		fmt.Fprintf(&b, "%d-%d %s\n", s.Start, s.End, strings.Join(addrs, ","))
	}
	if next != 16384 {
		return "", fmt.Errorf("slots %d-16383 unassigned", next)
	}
	if len(seen) != nodes {
		return "", fmt.Errorf("slot map names %d nodes, want %d", len(seen), nodes)
	}
	return b.String(), nil
}

// infoFields parses INFO / CLUSTER INFO "key:value" lines.
func infoFields(info string) map[string]string {
	m := map[string]string{}
	for line := range strings.Lines(info) {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
			m[k] = v
		}
	}
	return m
}

// Client returns a new go-redis cluster client seeded with every node's
// address, so it can find the cluster while some nodes are down. It is closed
// when the test ends.
func (c *Cluster) Client() *redis.ClusterClient {
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs})
	c.t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// query runs f against the first node that answers, skipping stopped ones,
// so that MasterFor and ReplicaOf keep working while a test has nodes down.
// It fails the test if no node answers.
func (c *Cluster) query(what string, f func(*redis.Client) error) {
	c.t.Helper()
	var errs []error
	for _, node := range c.Nodes {
		if node.running() == nil {
			continue
		}
		err := withClient(node.Addr, f)
		if err == nil {
			return
		}
		errs = append(errs, fmt.Errorf("%s: %w", node.Addr, err))
	}
	c.t.Fatalf("testserver: %s: no cluster node answered: %v", what, errors.Join(errs...))
}

// node returns the node listening on addr, or nil.
func (c *Cluster) node(addr string) *Redis {
	for _, n := range c.Nodes {
		if n.Addr == addr {
			return n
		}
	}
	return nil
}

// MasterFor returns the node that currently serves key's slot as master, as
// seen by the first live node (CLUSTER KEYSLOT, then CLUSTER SLOTS). During a
// failover that node's view may lag. Call it from the test goroutine.
func (c *Cluster) MasterFor(key string) *Redis {
	c.t.Helper()
	ctx := context.Background()
	var master *Redis
	c.query("MasterFor("+key+")", func(cl *redis.Client) error {
		slot, err := cl.ClusterKeySlot(ctx, key).Result()
		if err != nil {
			return err
		}
		slots, err := cl.ClusterSlots(ctx).Result()
		if err != nil {
			return err
		}
		for _, s := range slots {
			if int64(s.Start) <= slot && slot <= int64(s.End) && len(s.Nodes) > 0 {
				if master = c.node(s.Nodes[0].Addr); master == nil {
					return fmt.Errorf("slot %d served by unknown node %s", slot, s.Nodes[0].Addr)
				}
				return nil
			}
		}
		return fmt.Errorf("slot %d is not served", slot)
	})
	return master
}

// ReplicaOf returns a replica of master, preferring one the cluster does not
// mark as failed, or nil if master has none. It works while master itself is
// stopped. Call it from the test goroutine.
func (c *Cluster) ReplicaOf(master *Redis) *Redis {
	c.t.Helper()
	id, ok := c.ids[master]
	if !ok {
		c.t.Fatalf("testserver: ReplicaOf: %v is not a node of this cluster", master)
	}
	var healthy, failed *Redis
	c.query("ReplicaOf("+master.Addr+")", func(cl *redis.Client) error {
		healthy, failed = nil, nil
		// CLUSTER REPLICAS answers in CLUSTER NODES format:
		// <id> <ip:port@cport[,hostname]> <flags> <master-id> ...
		lines, err := cl.Do(context.Background(), "CLUSTER", "REPLICAS", id).StringSlice()
		if err != nil {
			return err
		}
		for _, line := range lines {
			f := strings.Fields(line)
			if len(f) < 3 {
				return fmt.Errorf("unexpected CLUSTER REPLICAS line %q", line)
			}
			addr, _, _ := strings.Cut(f[1], "@")
			n := c.node(addr)
			if n == nil {
				return fmt.Errorf("replica %s is not a node of this cluster", addr)
			}
			if strings.Contains(f[2], "fail") {
				failed = n
			} else if healthy == nil {
				healthy = n
			}
		}
		return nil
	})
	if healthy != nil {
		return healthy
	}
	return failed
}
