/**
 * `SampleGroups` and `SampleGroup`: n > 1 gathered as its samples are submitted, and what the
 * group's attempt carries.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { type GroupSample, isRider, type SampleGroup, SampleGroups, withRiders } from "./sample-group.js";

interface Sample extends GroupSample<Sample> {
  group: SampleGroup<Sample> | null;
}

function sample(rid: number, extra: Partial<GenerationRequest> = {}): Sample {
  const request: GenerationRequest = {
    rid,
    tenant: 0,
    promptTokens: Int32Array.from({ length: 40 }, (_, i) => i),
    maxTokens: 8,
    sampling: { temperature: 1, topP: 1, topK: 0, seed: rid * 10, stopTokenIds: [] },
    ...extra,
  };
  return { request, rid, silenced: false, group: null };
}

test("SampleGroups.add() holds a group's samples until the last one came, then gives its first", () => {
  const groups = new SampleGroups<Sample>();
  const alone = sample(7);
  assert.equal(groups.add(alone), alone, "a request of one sample is ready at once");
  assert.equal(alone.group, null);
  const first = sample(1, { samples: [2, 3] });
  const second = sample(2, { sample: { of: 1, index: 1 } });
  const third = sample(3, { sample: { of: 1, index: 2 } });
  assert.equal(groups.add(first), null);
  assert.equal(groups.add(second), null);
  assert.equal(groups.add(third), first);
  const group = first.group!;
  assert.deepEqual(withRiders(first), [first, second, third]);
  assert.deepEqual([isRider(first), isRider(second), isRider(third)], [false, true, true]);
  assert.equal(group.size, 3);
  // Every sample's pages past the prompt's two full pages, those once: 3 + 2 × 1.
  assert.equal(group.decodePages(16), 5);
  // A rider aborted while the group waited stays behind at its dispatch.
  second.silenced = true;
  assert.deepEqual(group.board(), [third]);
  third.rid = 4;
  assert.deepEqual(group.rids(), [4]);
  const sampling = group.sampling({
    temperature: 1,
    topP: 1,
    topK: 0,
    seed: 10,
    stopTokenIds: [],
    sampleSeeds: [1],
  });
  assert.deepEqual(sampling.sampleSeeds, [30]);
  // A later sample whose group is not being assembled goes alone.
  const stray = sample(9, { sample: { of: 1, index: 3 } });
  assert.equal(groups.add(stray), stray);
});

test("SampleGroup.split() leaves every sample alone", () => {
  const groups = new SampleGroups<Sample>();
  const first = sample(1, { samples: [2] });
  const rider = sample(2, { sample: { of: 1, index: 1 } });
  groups.add(first);
  groups.add(rider);
  assert.deepEqual(first.group!.split(), [rider]);
  assert.deepEqual([first.group, rider.group], [null, null]);
  assert.deepEqual(withRiders(first), [first]);
  assert.equal(isRider(rider), false);
});
