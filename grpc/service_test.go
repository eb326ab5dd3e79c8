package idempotencygrpc_test

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-go/idempotency"
	idempotencygrpc "github.com/idempotency-go/idempotency/grpc"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// The test service, payments.v1.Payments, with no generated code: its
// descriptor is registered here as protoc-gen-go would register it, and its
// ServiceDesc is written as protoc-gen-go-grpc would write it. Requests and
// replies are google.protobuf.Struct, a message Go already has.
const (
	chargeMethod  = "/payments.v1.Payments/Charge"
	balanceMethod = "/payments.v1.Payments/Balance"
)

func init() {
	msg := proto.String(".google.protobuf.Struct")
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name:       proto.String("payments/v1/payments.proto"),
		Package:    proto.String("payments.v1"),
		Dependency: []string{"google/protobuf/struct.proto"},
		Syntax:     proto.String("proto3"),
		Service: []*descriptorpb.ServiceDescriptorProto{{
			Name: proto.String("Payments"),
			Method: []*descriptorpb.MethodDescriptorProto{
				{Name: proto.String("Charge"), InputType: msg, OutputType: msg},
				{Name: proto.String("Balance"), InputType: msg, OutputType: msg},
			},
		}},
	}, protoregistry.GlobalFiles)
	if err != nil {
		panic(err)
	}
	if err := protoregistry.GlobalFiles.RegisterFile(fd); err != nil {
		panic(err)
	}
}

type paymentsServer interface {
	Charge(context.Context, *structpb.Struct) (*structpb.Struct, error)
	Balance(context.Context, *structpb.Struct) (*structpb.Struct, error)
}

func paymentsDesc() *grpc.ServiceDesc {
	return &grpc.ServiceDesc{
		ServiceName: "payments.v1.Payments",
		HandlerType: (*paymentsServer)(nil),
		Methods: []grpc.MethodDesc{
			{MethodName: "Charge", Handler: unaryHandler(chargeMethod, paymentsServer.Charge)},
			{MethodName: "Balance", Handler: unaryHandler(balanceMethod, paymentsServer.Balance)},
		},
		Metadata: "payments/v1/payments.proto",
	}
}

// unaryHandler is a method's handler as protoc-gen-go-grpc writes it.
func unaryHandler(fullMethod string, m func(paymentsServer, context.Context, *structpb.Struct) (*structpb.Struct, error)) grpc.MethodHandler {
	return func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
		in := new(structpb.Struct)
		if err := dec(in); err != nil {
			return nil, err
		}
		h := func(ctx context.Context, req any) (any, error) {
			return m(srv.(paymentsServer), ctx, req.(*structpb.Struct))
		}
		if interceptor == nil {
			return h(ctx, in)
		}
		return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: fullMethod}, h)
	}
}

// payments implements the service. Charge counts its runs and answers
// charge's reply, by default a charge whose id is the operation's
// downstream key and which says which run made it; Balance answers at once.
type payments struct {
	runs   atomic.Int64
	charge func(ctx context.Context, run int64, in *structpb.Struct) (*structpb.Struct, error)
}

func (p *payments) Charge(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
	run := p.runs.Add(1)
	if p.charge != nil {
		return p.charge(ctx, run, in)
	}
	return receipt(ctx, run, in), nil
}

func (p *payments) Balance(context.Context, *structpb.Struct) (*structpb.Struct, error) {
	return structpb.NewStruct(map[string]any{"balance": 100})
}

// receipt is the reply to a charge: its id, amount and the run that made it.
func receipt(ctx context.Context, run int64, in *structpb.Struct) *structpb.Struct {
	dk, _ := idempotency.DownstreamKey(ctx, "gateway") // "" for a call without a key, which runs unguarded
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		"id":     structpb.NewStringValue("ch_" + dk),
		"amount": in.GetFields()["amount"],
		"run":    structpb.NewNumberValue(float64(run)),
	}}
}

func amount(n float64) *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{"amount": structpb.NewNumberValue(n)}}
}

// arrivals records, in front of the interceptor under test, the
// idempotency-key values of every call that reached a server, and the code
// of every answer, in the order of the answers.
type arrivals struct {
	mu    sync.Mutex
	keys  [][]string
	codes []codes.Code
}

func (a *arrivals) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	a.mu.Lock()
	a.keys = append(a.keys, metadata.ValueFromIncomingContext(ctx, idempotencygrpc.MetadataKey))
	a.mu.Unlock()
	resp, err := handler(ctx, req)
	a.mu.Lock()
	a.codes = append(a.codes, status.Code(err))
	a.mu.Unlock()
	return resp, err
}

// Keys returns the key values of every call so far, by arrival.
func (a *arrivals) Keys() [][]string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([][]string(nil), a.keys...)
}

// Codes returns the codes of the answers so far.
func (a *arrivals) Codes() []codes.Code {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]codes.Code(nil), a.codes...)
}

// instance is one server of the service, as one process would run it.
type instance struct {
	addr  string
	guard *idempotency.Guard
	seen  *arrivals
}

// serve starts a grpc.Server for svc on a loopback port, with g's
// interceptor behind an arrivals recorder, until t ends.
func serve(t *testing.T, g *idempotency.Guard, o idempotencygrpc.ServerOptions, svc paymentsServer, opts ...grpc.ServerOption) *instance {
	t.Helper()
	in := &instance{guard: g, seen: &arrivals{}}
	opts = append(opts, grpc.ChainUnaryInterceptor(in.seen.intercept, idempotencygrpc.UnaryServerInterceptor(g, o)))
	srv := grpc.NewServer(opts...)
	srv.RegisterService(paymentsDesc(), svc)
	in.addr = listenAndServe(t, srv)
	return in
}

// listenAndServe serves srv on a loopback port until t ends, and returns
// its address.
func listenAndServe(t *testing.T, srv *grpc.Server) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return ln.Addr().String()
}

// redisGuards returns n Guards on one fresh redis-server, each with a store
// and a client of its own, as n processes would have.
func redisGuards(t *testing.T, n int, opts idempotency.Options) []*idempotency.Guard {
	t.Helper()
	r := testserver.StartRedis(t)
	guards := make([]*idempotency.Guard, n)
	for i := range guards {
		store, err := idempotency.NewRedisStore(r.Client(), idempotency.RedisOptions{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = store.Close() })
		guards[i] = idempotency.New(store, opts)
	}
	return guards
}

// pair is two instances of the service on one Redis, sharing svc so that
// its run count is the service's.
func pair(t *testing.T, opts idempotency.Options, o idempotencygrpc.ServerOptions, svc *payments) [2]*instance {
	t.Helper()
	g := redisGuards(t, 2, opts)
	return [2]*instance{serve(t, g[0], o, svc), serve(t, g[1], o, svc)}
}

// dial returns a client of addr, closed when t ends.
func dial(t *testing.T, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// charge calls Charge with the given idempotency-key values (none: no key)
// and returns the reply, the header metadata and the error.
func charge(ctx context.Context, conn *grpc.ClientConn, req *structpb.Struct, keys ...string) (*structpb.Struct, metadata.MD, error) {
	for _, k := range keys {
		ctx = metadata.AppendToOutgoingContext(ctx, idempotencygrpc.MetadataKey, k)
	}
	var header metadata.MD
	reply := new(structpb.Struct)
	err := conn.Invoke(ctx, chargeMethod, req, reply, grpc.Header(&header))
	if err != nil {
		return nil, header, err
	}
	return reply, header, nil
}

func replayed(md metadata.MD) bool {
	v := md.Get(idempotencygrpc.MetadataReplayed)
	return len(v) == 1 && v[0] == "true"
}
