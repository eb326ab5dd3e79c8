package idempotencygrpc_test

import (
	"context"
	"fmt"
	"log"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-go/idempotency"
	idempotencygrpc "github.com/idempotency-go/idempotency/grpc"
)

// A server that charges at most once per key, and a client that sends one
// key with every attempt at a call. payments.v1.Payments is described in
// service_test.go, as protoc would generate it.
func Example() {
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		idempotencygrpc.UnaryServerInterceptor(guard, idempotencygrpc.ServerOptions{
			Scope:   idempotencygrpc.SingleTenant,
			Methods: func(method string) bool { return method == chargeMethod },
		})))
	svc := &payments{charge: func(_ context.Context, run int64, in *structpb.Struct) (*structpb.Struct, error) {
		return structpb.NewStruct(map[string]any{"id": fmt.Sprintf("ch_%d", run), "amount": in.AsMap()["amount"]})
	}}
	srv.RegisterService(paymentsDesc(), svc)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()

	conn, err := grpc.NewClient(ln.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(idempotencygrpc.UnaryClientInterceptor(idempotencygrpc.ClientOptions{})))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()

	// The caller chose the key, say stored with the order it pays for, and
	// calls twice, as after a crash.
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotencygrpc.MetadataKey, "order-1842")
	req, _ := structpb.NewStruct(map[string]any{"amount": 4200})
	for range 2 {
		var header metadata.MD
		reply := new(structpb.Struct)
		if err := conn.Invoke(ctx, chargeMethod, req, reply, grpc.Header(&header)); err != nil {
			log.Fatal(err)
		}
		fmt.Println(reply.AsMap()["id"], reply.AsMap()["amount"], header.Get(idempotencygrpc.MetadataReplayed))
	}
	fmt.Println("charges:", svc.runs.Load())
	// Output:
	// ch_1 4200 []
	// ch_1 4200 [true]
	// charges: 1
}
