/**
 * Tool calls in OpenAI's wire shapes (issue #34): chat's `message.tool_calls` and the stream's
 * `delta.tool_calls` pieces (`{index, id, type, function: {name, arguments}}` first, then
 * `{index, function: {arguments}}` fragments), and the Responses API's `function_call` output items
 * with their stream events (`response.output_item.added`, `response.function_call_arguments.delta`
 * and `.done`, `response.output_item.done`), placed after the message item (output 0).
 */
import type { ParsedToolCall, ToolCallDelta } from "./tool-call-parser.js";

/** Chat's `message.tool_calls`. */
export function chatToolCalls(calls: readonly ParsedToolCall[]) {
  return calls.map((call) => ({
    id: call.id,
    type: "function" as const,
    function: { name: call.name, arguments: call.arguments },
  }));
}

/** One call's piece in a chat chunk's `delta.tool_calls`. */
export function chatToolCallDelta(delta: ToolCallDelta): Record<string, unknown> {
  if (delta.name === undefined) return { index: delta.index, function: { arguments: delta.arguments } };
  return {
    index: delta.index,
    id: delta.id,
    type: "function",
    function: { name: delta.name, arguments: delta.arguments },
  };
}

/** A Responses `function_call` item's id: `fc_` and the call id's random part. */
function itemId(callId: string): string {
  return `fc_${callId.slice("call_".length)}`;
}

/** A Responses `function_call` output item. */
export function functionCallItem(call: ParsedToolCall, status: "in_progress" | "completed") {
  return {
    id: itemId(call.id),
    type: "function_call" as const,
    status,
    arguments: status === "in_progress" ? "" : call.arguments,
    call_id: call.id,
    name: call.name,
  };
}

/** The output index of call `index`: after the message item. */
const outputIndex = (index: number) => 1 + index;

/** The stream events of one call's piece: the item's opening, or an arguments delta. */
export function functionCallEvents(
  delta: ToolCallDelta,
  calls: readonly ParsedToolCall[],
): Record<string, unknown>[] {
  const call = calls[delta.index]!;
  if (delta.name !== undefined)
    return [
      {
        type: "response.output_item.added",
        output_index: outputIndex(delta.index),
        item: functionCallItem(call, "in_progress"),
      },
    ];
  return [
    {
      type: "response.function_call_arguments.delta",
      item_id: itemId(call.id),
      output_index: outputIndex(delta.index),
      delta: delta.arguments,
    },
  ];
}

/** The stream events that close every call once the output ended. */
export function functionCallsDone(calls: readonly ParsedToolCall[]): Record<string, unknown>[] {
  return calls.flatMap((call, index) => [
    {
      type: "response.function_call_arguments.done",
      item_id: itemId(call.id),
      output_index: outputIndex(index),
      arguments: call.arguments,
    },
    {
      type: "response.output_item.done",
      output_index: outputIndex(index),
      item: functionCallItem(call, "completed"),
    },
  ]);
}
