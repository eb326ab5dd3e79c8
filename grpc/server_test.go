package idempotencygrpc_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-go/idempotency"
	idempotencygrpc "github.com/idempotency-go/idempotency/grpc"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// hang bounds every wait for a condition: it only catches a hang.
const hang = 10 * time.Second

// waiting reports the calls of all guards waiting for an original in flight.
func waiting(guards ...*idempotency.Guard) int {
	n := 0
	for _, g := range guards {
		_, w := g.InFlight()
		n += w
	}
	return n
}

func TestDuplicatesAcrossInstances(t *testing.T) {
	release := make(chan struct{})
	svc := &payments{charge: func(ctx context.Context, run int64, in *structpb.Struct) (*structpb.Struct, error) {
		select {
		case <-release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return receipt(ctx, run, in), nil
	}}
	inst := pair(t, idempotency.Options{}, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc)
	conns := [2]*grpc.ClientConn{dial(t, inst[0].addr), dial(t, inst[1].addr)}

	const n = 8
	type answer struct {
		reply    *structpb.Struct
		replayed bool
		err      error
	}
	answers := make([]answer, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			reply, md, err := charge(t.Context(), conns[i%2], amount(4200), "k-dup")
			answers[i] = answer{reply, replayed(md), err}
		})
	}
	// Every duplicate waits for the one running, on either instance.
	require.Eventually(t, func() bool {
		return svc.runs.Load() == 1 && waiting(inst[0].guard, inst[1].guard) == n-1
	}, hang, time.Millisecond)
	close(release)
	wg.Wait()

	first := answers[0].reply
	fresh := 0
	for i, a := range answers {
		require.NoError(t, a.err, "call %d", i)
		protoEqual(t, first, a.reply, "call %d got another reply", i)
		if !a.replayed {
			fresh++
		}
	}
	assert.Equal(t, 1, fresh, "exactly one call's reply is not marked replayed")
	assert.Equal(t, int64(1), svc.runs.Load(), "the handler ran once")
	assert.True(t, strings.HasPrefix(first.GetFields()["id"].GetStringValue(), "ch_idem_"), "reply: %v", first)

	// A retry later, on either instance, replays the reply.
	for _, conn := range conns {
		reply, md, err := charge(t.Context(), conn, amount(4200), "k-dup")
		require.NoError(t, err)
		protoEqual(t, first, reply)
		assert.True(t, replayed(md), "header: %v", md)
	}
	assert.Equal(t, int64(1), svc.runs.Load())
}

func TestStoredErrorReplays(t *testing.T) {
	svc := &payments{charge: func(context.Context, int64, *structpb.Struct) (*structpb.Struct, error) {
		st, err := status.New(codes.NotFound, "no such payment source: tok_gone").WithDetails(
			&errdetails.ErrorInfo{Reason: "SOURCE_NOT_FOUND", Domain: "payments.example.com", Metadata: map[string]string{"source": "tok_gone"}},
			&errdetails.LocalizedMessage{Locale: "en-US", Message: "That card is gone."})
		require.NoError(t, err)
		return nil, st.Err()
	}}
	inst := pair(t, idempotency.Options{}, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc)

	_, md, err := charge(t.Context(), dial(t, inst[0].addr), amount(4200), "k-err")
	want := status.Convert(err)
	require.Equal(t, codes.NotFound, want.Code(), "first answer: %v", err)
	require.Len(t, want.Details(), 2)
	assert.False(t, replayed(md))

	_, md, err = charge(t.Context(), dial(t, inst[1].addr), amount(4200), "k-err")
	got := status.Convert(err)
	assert.Equal(t, want.Code(), got.Code())
	assert.Equal(t, want.Message(), got.Message())
	protoEqual(t, want.Proto(), got.Proto(), "the status and its details")
	assert.True(t, replayed(md), "header: %v", md)
	assert.Equal(t, int64(1), svc.runs.Load(), "the handler ran once")
}

func TestMismatch(t *testing.T) {
	svc := &payments{}
	inst := pair(t, idempotency.Options{}, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc)
	conn := dial(t, inst[0].addr)
	_, _, err := charge(t.Context(), conn, amount(4200), "k-mis")
	require.NoError(t, err)

	// Another amount, at the other instance.
	_, _, err = charge(t.Context(), dial(t, inst[1].addr), amount(9900), "k-mis")
	assert.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)

	// The same request to another method: the method is part of the request.
	ctx := metadata.AppendToOutgoingContext(t.Context(), idempotencygrpc.MetadataKey, "k-mis")
	err = conn.Invoke(ctx, balanceMethod, amount(4200), new(structpb.Struct))
	assert.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	assert.Equal(t, int64(1), svc.runs.Load())
}

func TestInFlight(t *testing.T) {
	release := make(chan struct{})
	svc := &payments{charge: func(ctx context.Context, run int64, in *structpb.Struct) (*structpb.Struct, error) {
		<-release
		return receipt(ctx, run, in), nil
	}}
	// Duplicates do not wait: they are answered at once.
	inst := pair(t, idempotency.Options{WaitTimeout: -1}, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant, RetryAfter: 250 * time.Millisecond}, svc)

	original := make(chan error, 1)
	go func() {
		_, _, err := charge(t.Context(), dial(t, inst[0].addr), amount(4200), "k-busy")
		original <- err
	}()
	require.Eventually(t, func() bool { ops, _ := inst[0].guard.InFlight(); return ops == 1 }, hang, time.Millisecond)

	var trailer metadata.MD
	ctx := metadata.AppendToOutgoingContext(t.Context(), idempotencygrpc.MetadataKey, "k-busy")
	err := dial(t, inst[1].addr).Invoke(ctx, chargeMethod, amount(4200), new(structpb.Struct), grpc.Trailer(&trailer))
	assert.Equal(t, codes.Aborted, status.Code(err), "%v", err)
	assert.Equal(t, []string{"250"}, trailer.Get("grpc-retry-pushback-ms"))

	close(release)
	require.NoError(t, <-original)
	assert.Equal(t, int64(1), svc.runs.Load())
}

func TestCallerGone(t *testing.T) {
	release := make(chan struct{})
	svc := &payments{charge: func(ctx context.Context, run int64, in *structpb.Struct) (*structpb.Struct, error) {
		<-release
		return receipt(ctx, run, in), nil
	}}
	inst := pair(t, idempotency.Options{}, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc)
	original := make(chan error, 1)
	go func() {
		_, _, err := charge(t.Context(), dial(t, inst[0].addr), amount(4200), "k-gone")
		original <- err
	}()
	require.Eventually(t, func() bool { return svc.runs.Load() == 1 }, hang, time.Millisecond)

	ctx, cancel := context.WithCancel(t.Context())
	dup := make(chan error, 1)
	go func() {
		_, _, err := charge(ctx, dial(t, inst[1].addr), amount(4200), "k-gone")
		dup <- err
	}()
	require.Eventually(t, func() bool { return waiting(inst[1].guard) == 1 }, hang, time.Millisecond)
	cancel()
	assert.Equal(t, codes.Canceled, status.Code(<-dup))
	// The server answers the duplicate it was waiting for with the caller's
	// code, not with one that an outage alert counts.
	require.Eventually(t, func() bool { return len(inst[1].seen.Codes()) == 1 }, hang, time.Millisecond)
	assert.Equal(t, []codes.Code{codes.Canceled}, inst[1].seen.Codes())

	close(release)
	require.NoError(t, <-original)
}

func TestDispositions(t *testing.T) {
	t.Run("released key runs again", func(t *testing.T) {
		svc := &payments{charge: func(ctx context.Context, run int64, in *structpb.Struct) (*structpb.Struct, error) {
			if run == 1 {
				return nil, status.Error(codes.Unavailable, "gateway down")
			}
			return receipt(ctx, run, in), nil
		}}
		inst := pair(t, idempotency.Options{}, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc)
		_, md, err := charge(t.Context(), dial(t, inst[0].addr), amount(4200), "k-rel")
		require.Equal(t, codes.Unavailable, status.Code(err))
		assert.Empty(t, md.Get("grpc-retry-pushback-ms"), "the handler's own answer")

		// The released key stays bound to its request.
		_, _, err = charge(t.Context(), dial(t, inst[1].addr), amount(1), "k-rel")
		assert.Equal(t, codes.FailedPrecondition, status.Code(err))

		reply, md, err := charge(t.Context(), dial(t, inst[1].addr), amount(4200), "k-rel")
		require.NoError(t, err)
		assert.False(t, replayed(md))
		assert.Equal(t, 2.0, reply.GetFields()["run"].GetNumberValue())

		again, md, err := charge(t.Context(), dial(t, inst[0].addr), amount(4200), "k-rel")
		require.NoError(t, err)
		assert.True(t, replayed(md))
		protoEqual(t, reply, again)
		assert.Equal(t, int64(2), svc.runs.Load())
	})
	t.Run("forgotten key takes a corrected request", func(t *testing.T) {
		svc := &payments{charge: func(ctx context.Context, run int64, in *structpb.Struct) (*structpb.Struct, error) {
			if in.GetFields()["amount"].GetNumberValue() <= 0 {
				return nil, status.Error(codes.InvalidArgument, "amount must be positive")
			}
			return receipt(ctx, run, in), nil
		}}
		inst := pair(t, idempotency.Options{}, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc)
		_, _, err := charge(t.Context(), dial(t, inst[0].addr), amount(-5), "k-fix")
		require.Equal(t, codes.InvalidArgument, status.Code(err))
		reply, md, err := charge(t.Context(), dial(t, inst[1].addr), amount(5), "k-fix")
		require.NoError(t, err)
		assert.False(t, replayed(md))
		assert.Equal(t, 5.0, reply.GetFields()["amount"].GetNumberValue())
	})
	t.Run("a refusal after a failed attempt keeps the operation", func(t *testing.T) {
		var charges atomic.Int32
		keys := make(chan string, 3)
		svc := &payments{charge: func(ctx context.Context, run int64, in *structpb.Struct) (*structpb.Struct, error) {
			dk, err := idempotency.DownstreamKey(ctx, "gateway")
			require.NoError(t, err)
			keys <- dk
			_, err = idempotency.Step(ctx, "charge", func(context.Context) (string, error) { charges.Add(1); return "ch_1", nil })
			require.NoError(t, err)
			switch run {
			case 1:
				return nil, status.Error(codes.Unavailable, "the ledger write failed")
			case 2:
				return nil, status.Error(codes.PermissionDenied, "the token expired")
			}
			return receipt(ctx, run, in), nil
		}}
		inst := pair(t, idempotency.Options{}, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc)
		for i, want := range []codes.Code{codes.Unavailable, codes.PermissionDenied, codes.OK} {
			_, _, err := charge(t.Context(), dial(t, inst[i%2].addr), amount(4200), "k-refused")
			require.Equal(t, want, status.Code(err), "attempt %d", i+1)
		}
		assert.Equal(t, int32(1), charges.Load(), "runs of the step recorded by the first attempt")
		first := <-keys
		assert.Equal(t, first, <-keys, "the second attempt's downstream key")
		assert.Equal(t, first, <-keys, "the third attempt's downstream key")
	})
	t.Run("a handler's choice stands where the policy keeps", func(t *testing.T) {
		svc := &payments{charge: func(ctx context.Context, run int64, in *structpb.Struct) (*structpb.Struct, error) {
			if run == 1 {
				// Accepted, not settled yet: let the retry ask again.
				require.True(t, idempotency.SetDisposition(ctx, idempotency.Release))
			}
			return receipt(ctx, run, in), nil
		}}
		inst := pair(t, idempotency.Options{}, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc)
		for _, in := range inst {
			_, md, err := charge(t.Context(), dial(t, in.addr), amount(4200), "k-pending")
			require.NoError(t, err)
			assert.False(t, replayed(md))
		}
		assert.Equal(t, int64(2), svc.runs.Load())
	})
	t.Run("a handler's choice stands where the policy forgets", func(t *testing.T) {
		svc := &payments{charge: func(ctx context.Context, run int64, in *structpb.Struct) (*structpb.Struct, error) {
			require.True(t, idempotency.SetDisposition(ctx, idempotency.Keep))
			return nil, status.Error(codes.FailedPrecondition, "card declined")
		}}
		inst := pair(t, idempotency.Options{}, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc)
		for i, in := range inst {
			_, md, err := charge(t.Context(), dial(t, in.addr), amount(4200), "k-declined")
			require.Equal(t, codes.FailedPrecondition, status.Code(err))
			assert.Equal(t, i == 1, replayed(md), "the kept decline is replayed")
		}
		assert.Equal(t, int64(1), svc.runs.Load())
	})
	t.Run("a policy of one's own", func(t *testing.T) {
		svc := &payments{charge: func(context.Context, int64, *structpb.Struct) (*structpb.Struct, error) {
			return nil, status.Error(codes.FailedPrecondition, "card declined")
		}}
		keepDeclines := func(c codes.Code) idempotency.Disposition {
			if c == codes.FailedPrecondition {
				return idempotency.Keep
			}
			return idempotencygrpc.DefaultDisposition(c)
		}
		inst := pair(t, idempotency.Options{}, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant, Disposition: keepDeclines}, svc)
		for _, in := range inst {
			_, _, err := charge(t.Context(), dial(t, in.addr), amount(4200), "k-declined")
			assert.Equal(t, codes.FailedPrecondition, status.Code(err))
		}
		assert.Equal(t, int64(1), svc.runs.Load(), "the decline was kept and replayed")
	})
}

func TestDefaultDisposition(t *testing.T) {
	want := map[idempotency.Disposition][]codes.Code{
		idempotency.Keep: {codes.OK, codes.NotFound, codes.AlreadyExists},
		idempotency.Forget: {codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange,
			codes.Unauthenticated, codes.PermissionDenied},
		idempotency.Release: {codes.Canceled, codes.Unknown, codes.DeadlineExceeded, codes.ResourceExhausted,
			codes.Aborted, codes.Unimplemented, codes.Internal, codes.Unavailable, codes.DataLoss},
	}
	listed := map[codes.Code]bool{}
	for d, cs := range want {
		for _, c := range cs {
			assert.Equal(t, d, idempotencygrpc.DefaultDisposition(c), "%v", c)
			listed[c] = true
		}
	}
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		assert.True(t, listed[c], "%v is not listed", c)
	}
}

func TestKeys(t *testing.T) {
	svc := &payments{}
	g := redisGuards(t, 1, idempotency.Options{})[0]
	optional := dial(t, serve(t, g, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc).addr)
	required := dial(t, serve(t, g, idempotencygrpc.ServerOptions{
		Scope:      idempotencygrpc.SingleTenant,
		RequireKey: true,
		Methods:    func(m string) bool { return m == chargeMethod },
	}, svc).addr)

	for _, c := range []struct {
		name string
		conn *grpc.ClientConn
		keys []string
	}{
		{"repeated", optional, []string{"k-1", "k-2"}},
		{"repeated, same value", optional, []string{"k-1", "k-1"}},
		{"not visible ASCII", optional, []string{"k 1"}},
		{"too long", optional, []string{strings.Repeat("k", idempotency.MaxKeyLength+1)}},
		{"missing, required", required, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, _, err := charge(t.Context(), c.conn, amount(4200), c.keys...)
			assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		})
	}
	assert.Zero(t, svc.runs.Load(), "no refused call ran")

	t.Run("missing, optional: unguarded", func(t *testing.T) {
		for range 2 {
			_, md, err := charge(t.Context(), optional, amount(4200))
			require.NoError(t, err)
			assert.False(t, replayed(md))
		}
		assert.Equal(t, int64(2), svc.runs.Load())
	})
	t.Run("method not guarded", func(t *testing.T) {
		ctx := metadata.AppendToOutgoingContext(t.Context(), idempotencygrpc.MetadataKey, "k 1", idempotencygrpc.MetadataKey, "k 2")
		require.NoError(t, required.Invoke(ctx, balanceMethod, amount(0), new(structpb.Struct)))
	})
	t.Run("longest key", func(t *testing.T) {
		_, _, err := charge(t.Context(), required, amount(4200), strings.Repeat("k", idempotency.MaxKeyLength))
		require.NoError(t, err)
	})
}

func TestScope(t *testing.T) {
	svc := &payments{}
	g := redisGuards(t, 1, idempotency.Options{})[0]
	accounts := func(ctx context.Context, method string) (string, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		switch acct := md.Get("x-account-id"); {
		case len(acct) != 1:
			return "", status.Error(codes.Unauthenticated, "who are you?")
		case acct[0] == "acct_broken":
			return "", errors.New("accounts.internal:7000 refused") // not a status: its text is not sent
		default:
			return acct[0], nil
		}
	}
	conn := dial(t, serve(t, g, idempotencygrpc.ServerOptions{Scope: accounts}, svc).addr)
	as := func(acct string) context.Context {
		return metadata.AppendToOutgoingContext(t.Context(), "x-account-id", acct)
	}

	a, _, err := charge(as("acct_a"), conn, amount(4200), "k-shared")
	require.NoError(t, err)
	b, md, err := charge(as("acct_b"), conn, amount(4200), "k-shared")
	require.NoError(t, err)
	assert.False(t, replayed(md), "another account's key is another record")
	assert.False(t, proto.Equal(a, b), "the accounts' replies")
	_, md, err = charge(as("acct_a"), conn, amount(4200), "k-shared")
	require.NoError(t, err)
	assert.True(t, replayed(md))

	_, _, err = charge(t.Context(), conn, amount(4200), "k-shared")
	assert.Equal(t, codes.Unauthenticated, status.Code(err), "the hook's own status")
	_, _, err = charge(as("acct_broken"), conn, amount(4200), "k-shared")
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
	assert.NotContains(t, status.Convert(err).Message(), "accounts.internal")
	assert.Equal(t, int64(2), svc.runs.Load())
}

func TestStoreUnavailable(t *testing.T) {
	svc := &payments{}
	r := testserver.StartRedis(t)
	store, err := idempotency.NewRedisStore(r.Client(), idempotency.RedisOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	conn := dial(t, serve(t, idempotency.New(store, idempotency.Options{}), idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc).addr)
	r.Stop(t)

	var trailer metadata.MD
	ctx := metadata.AppendToOutgoingContext(t.Context(), idempotencygrpc.MetadataKey, "k-down")
	err = conn.Invoke(ctx, chargeMethod, amount(4200), new(structpb.Struct), grpc.Trailer(&trailer))
	assert.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	assert.NotContains(t, status.Convert(err).Message(), r.Addr, "no store address reaches the client")
	assert.Equal(t, []string{"1000"}, trailer.Get("grpc-retry-pushback-ms"))
	assert.Zero(t, svc.runs.Load(), "nothing runs unguarded")
}

func TestFencedOwner(t *testing.T) {
	r := testserver.StartRedis(t)
	store, err := idempotency.NewRedisStore(r.Client(), idempotency.RedisOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	started := make(chan struct{}, 1)
	svc := &payments{charge: func(ctx context.Context, run int64, in *structpb.Struct) (*structpb.Struct, error) {
		if run == 1 {
			started <- struct{}{}
			<-ctx.Done() // the lease ends: the store cannot be reached to renew it
			return receipt(ctx, run, in), nil
		}
		return receipt(ctx, run, in), nil
	}}
	g := idempotency.New(store, idempotency.Options{Lease: 300 * time.Millisecond})
	conn := dial(t, serve(t, g, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant}, svc).addr)

	answer := make(chan error, 1)
	var trailer metadata.MD
	go func() {
		ctx := metadata.AppendToOutgoingContext(t.Context(), idempotencygrpc.MetadataKey, "k-fenced")
		answer <- conn.Invoke(ctx, chargeMethod, amount(4200), new(structpb.Struct), grpc.Trailer(&trailer))
	}()
	<-started
	r.Pause(t)
	err = <-answer
	r.Resume(t)
	assert.Equal(t, codes.Unavailable, status.Code(err), "the handler's reply is not sent: %v", err)
	assert.Equal(t, []string{"1000"}, trailer.Get("grpc-retry-pushback-ms"))

	// The abandoned record is taken over once its lease has run out.
	reply, md, err := charge(t.Context(), conn, amount(4200), "k-fenced")
	require.NoError(t, err)
	assert.False(t, replayed(md))
	assert.Equal(t, 2.0, reply.GetFields()["run"].GetNumberValue())
}

func TestUnregisteredMethod(t *testing.T) {
	const method = "/unregistered.v1.Ledger/Post"
	var ran atomic.Bool
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotencygrpc.UnaryServerInterceptor(
		idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{}),
		idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant})))
	desc := paymentsDesc()
	desc.ServiceName = "unregistered.v1.Ledger"
	desc.Methods = []grpc.MethodDesc{{MethodName: "Post", Handler: unaryHandler(method,
		func(paymentsServer, context.Context, *structpb.Struct) (*structpb.Struct, error) {
			ran.Store(true)
			return &structpb.Struct{}, nil
		})}}
	srv.RegisterService(desc, &payments{})
	addr := listenAndServe(t, srv)

	ctx := metadata.AppendToOutgoingContext(t.Context(), idempotencygrpc.MetadataKey, "k-1")
	err := dial(t, addr).Invoke(ctx, method, amount(1), new(structpb.Struct))
	assert.Equal(t, codes.Internal, status.Code(err), "%v", err)
	assert.Contains(t, status.Convert(err).Message(), "cannot be replayed")
	assert.False(t, ran.Load(), "an outcome that could never be replayed is not made")
}

// protoEqual asserts that got is the message want.
func protoEqual(t *testing.T, want, got proto.Message, msgAndArgs ...any) bool {
	t.Helper()
	if proto.Equal(want, got) {
		return true
	}
	return assert.Fail(t, fmt.Sprintf("messages differ:\nwant %v\ngot  %v", want, got), msgAndArgs...)
}

// A request message whose deterministic marshalling happens to be a JSON
// text (one string field 34 bytes long: tag '\n', length '"') must still be
// fingerprinted as the message it is, not as JSON: these two requests
// differ, so reusing the key with the second must fail, not replay the
// first's reply.
func TestProtoPayloadThatLooksLikeJSON(t *testing.T) {
	a := `abc"` + strings.Repeat(" ", 30)      // payload "\n" `"abc"` + spaces
	b := `\u0061bc"` + strings.Repeat(" ", 25) // payload "\n" `"\u0061bc"` + spaces
	require.Len(t, a, 34)
	require.Len(t, b, 34)

	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	intercept := idempotencygrpc.UnaryServerInterceptor(g, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant})
	info := &grpc.UnaryServerInfo{FullMethod: "/grpc.health.v1.Health/Check"}
	runs := 0
	handler := func(_ context.Context, req any) (any, error) {
		runs++
		if req.(*healthpb.HealthCheckRequest).GetService() == a {
			return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
		}
		return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_NOT_SERVING}, nil
	}
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(idempotencygrpc.MetadataKey, "k1"))

	reply, err := intercept(ctx, &healthpb.HealthCheckRequest{Service: a}, info, handler)
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, reply.(*healthpb.HealthCheckResponse).GetStatus())

	reply, err = intercept(ctx, &healthpb.HealthCheckRequest{Service: b}, info, handler)
	assert.Equal(t, codes.FailedPrecondition, status.Code(err), "got reply %v for another request", reply)
	assert.Equal(t, 1, runs)

	// The same message again is still replayed.
	_, err = intercept(ctx, &healthpb.HealthCheckRequest{Service: a}, info, handler)
	require.NoError(t, err)
	assert.Equal(t, 1, runs)
}

// An interceptor without a Scope is refused when it is built: sharing keys
// between tenants is a choice to make, with SingleTenant.
func TestServerRequiresScope(t *testing.T) {
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	assert.Panics(t, func() { idempotencygrpc.UnaryServerInterceptor(g, idempotencygrpc.ServerOptions{}) })
	assert.NotPanics(t, func() {
		idempotencygrpc.UnaryServerInterceptor(g, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant})
	})
}

// A Scope that names no account is refused, as one that fails is: only
// SingleTenant serves the empty scope.
func TestEmptyScopeRefused(t *testing.T) {
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	info := &grpc.UnaryServerInfo{FullMethod: "/grpc.health.v1.Health/Check"}
	runs := 0
	handler := func(context.Context, any) (any, error) {
		runs++
		return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
	}
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(idempotencygrpc.MetadataKey, "k1"))
	accountOf := func(ctx context.Context, _ string) (string, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		return strings.Join(md.Get("x-account-id"), ""), nil
	}
	_, err := idempotencygrpc.UnaryServerInterceptor(g, idempotencygrpc.ServerOptions{Scope: accountOf})(ctx, &healthpb.HealthCheckRequest{}, info, handler)
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "a call that names no account")
	assert.Zero(t, runs)
	_, err = idempotencygrpc.UnaryServerInterceptor(g, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant})(ctx, &healthpb.HealthCheckRequest{}, info, handler)
	require.NoError(t, err, "SingleTenant")
	assert.Equal(t, 1, runs)
}
